"""te-core standing in for the `transformer_engine` package, opt-in.

After `te_core.install_as_transformer_engine()`, code written for Transformer Engine imports
te-core: `import transformer_engine.pytorch as te`, `transformer_engine.common.recipe`, and the
submodules integrations reach into (`transformer_engine.pytorch.fp8` / `.quantization` with
check_fp8_support, check_mxfp8_support, FP8GlobalStateManager; `.distributed.checkpoint`;
`.module.base.TransformerEngineBaseModule`), TE's fusible-operation API without its fusions (`.ops`:
Sequential, Linear, the basic operations and their base classes, also by TE's files, `.ops.basic.<file>`),
the built-in recipes' quantizer factories (`.custom_recipes.quantizer_factories`) and its mixed-precision
ones (`.custom_recipes.quantizer_factory_zoo`), and the part of
`.attention.inference` the tutorials import.
Nothing is installed on disk: the modules live in sys.modules of this process only. A real
Transformer Engine found on the path is never shadowed unless asked for (replace=True).

Every stand-in module is a package whose submodules come from sys.modules only; while the
stand-in is installed, a finder at the end of sys.meta_path answers an import of any other
`transformer_engine.*` module (or `from <stand-in> import <name it lacks>`) with an error that
says what te-core provides, in place of Python's bare "No module named" / "(unknown location)".
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Optional, Tuple

import torch

from .fp8_state import GlobalStateControls
from .te_tensor_pickles import (TE_BLOCK_REBUILD, TE_FLOAT8_REBUILD, TE_MXFP8_REBUILD, TE_PICKLED_QUANTIZERS,
                                PickledQuantizer, rebuild_te_blockwise_tensor, rebuild_te_float8_tensor,
                                rebuild_te_mxfp8_tensor)
from .te_extension import EXTENSION, EXTENSION_HINT, constants, tensor_quantizers
from . import te_norm_cast
from .te_gemm import general_gemm
from .te_metadata import install_metadata, uninstall_metadata
from .te_ops_files import OPS_BASIC_FILES, OPS_FILES
from .te_thd import thd_get_partitioned_indices
from .te_userbuffers import USERBUFFERS_HINT, destroy_ub, device_supports_multicast

ROOT = "transformer_engine"
TE_API_VERSION = "2.20.0"  # the Transformer Engine release whose signatures te-core mirrors


def _module(name: str, doc: str) -> types.ModuleType:
    """A stand-in module. Each is a package (with no directory: its submodules come from
    sys.modules, never from disk), so that `from <it> import <missing name>` reaches the
    not-provided finder, which explains, rather than ending in Python's '(unknown location)'."""
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []
    module.__te_core_stand_in__ = True
    module.__getattr__ = _not_provided(name)
    return module


_NVFP4_HINT = "NVFP4 is not supported by te-core yet: transformer_engine.pytorch.is_nvfp4_available() is False"
_TENSORS_HINT = ("te-core's quantized tensors are transformer_engine.pytorch.QuantizedTensor and its subclasses "
                 "Float8Tensor, MXFP8Tensor and Float8BlockwiseQTensor (te_core.quantization); it has no "
                 "separate storage classes")
_KERNELS_HINT = "Transformer Engine's kernels and bindings; te-core's backends implement its op contract (te_core.ops)"
_ADAM_KERNEL_HINT = ("a kernel of Transformer Engine's extension, which its FusedAdam launches: step with "
                     "transformer_engine.pytorch.optimizers.FusedAdam, which runs the selected backend's multi-tensor "
                     "Adam")
_EP_HINT = ("Transformer Engine's expert-parallel dispatch and combine (ep_bootstrap, EpBuffer, ep_dispatch, "
            "ep_combine) run NCCL's device-initiated EP kernels, which te-core has no counterpart of, on any backend; "
            "exchange the tokens between the expert-parallel ranks with torch.distributed.all_to_all_single, order "
            "them by expert with transformer_engine.pytorch.moe_permute / moe_unpermute, and run the local experts "
            "with transformer_engine.pytorch.GroupedLinear")
_DEBUG_HINT = ("Transformer Engine's precision debug tools (transformer_engine.debug, driven by nvdlfw_inspect's "
               "debug_api) have no te-core counterpart, and te-core's modules never consult debug_api: leave "
               "debug_api.initialize() and debug_api.step() out; to keep a layer in high precision (DisableFP8Layer), "
               "run it under te.autocast(enabled=False) nested in the FP8 one; to log tensor statistics "
               "(LogTensorStats), register torch forward and backward hooks on the modules")
# Transformer Engine's blockwise-scaling docs page writes te.common.recipe.Format, which its own
# transformer_engine.pytorch does not have either: say where the recipes are
_COMMON_HINT = ("Transformer Engine's transformer_engine.pytorch has no 'common' either; import the recipes and Format "
                "from transformer_engine.common.recipe")
_OPS_HINT = ("te-core provides Transformer Engine's fusible-operation API as transformer_engine.pytorch.ops: "
             "Sequential, Linear, the basic operations (GroupedLinear, BasicLinear, Bias, LayerNorm, RMSNorm, "
             "L2Normalization, the activations, SwiGLU, ScaledSwiGLU, ClampedSwiGLU, ScaledClampedQGeGLU, SiTUGLU, "
             "ScaledSiTUGLU, ScaledSReLU, AllReduce, ReduceScatter, AllGather, MakeExtraOutput, AddExtraInput, "
             "ConstantScale, Identity, Reshape, Dropout, Quantize; also under ops.basic and in TE's files "
             "ops.basic.<file>) and the base classes, not its fused operations nor its fuser (te-core fuses "
             "nothing); its modules (transformer_engine.pytorch.Linear, LayerNormMLP, ...) are the other layers "
             "it provides")
# The nearest te-core counterpart of Transformer Engine names te-core does not provide, by the
# name's path under transformer_engine.pytorch (or its last part, for names found in several places)
_NEAREST = {
    "NVFP4Quantizer": _NVFP4_HINT, "NVFP4Tensor": _NVFP4_HINT, "NVFP4TensorStorage": _NVFP4_HINT,
    "tensor.nvfp4_tensor": _NVFP4_HINT,
    "QuantizedTensorStorage": _TENSORS_HINT, "Float8TensorStorage": _TENSORS_HINT,
    "MXFP8TensorStorage": _TENSORS_HINT, "Float8BlockwiseQTensorStorage": _TENSORS_HINT,
    "tensor.storage": _TENSORS_HINT,
    # (a key ending in ".*": every name under that module)
    "ops.*": _OPS_HINT, "ops.basic.*": _OPS_HINT,
    "custom_recipes.*": "of Transformer Engine's custom_recipes, te-core provides quantizer_factories (the built-in "
                        "recipes' factories, te_core.quantization.factories) and quantizer_factory_zoo (the "
                        "mixed-precision ones, te_core.quantization.factory_zoo; its NVFP4 choices raise), not its "
                        "reference quantizers or reference GEMMs",
    "attention.inference.*": "te-core's InferenceParams holds, and with is_paged=True pages, the KV caches itself, "
                             "without cache manager objects",
    "initialize_ub": USERBUFFERS_HINT, "UserBufferQuantizationMode": USERBUFFERS_HINT,
    "ep": _EP_HINT, "ep.*": _EP_HINT,
    "common": _COMMON_HINT, f"{ROOT}.debug": _DEBUG_HINT,
    "te_translation_table": "te-core does not export ONNX graphs of its FP8 modules; see onnx_export",
    "jit": _KERNELS_HINT, "triton": _KERNELS_HINT,
    "attention.dot_product_attention": "DotProductAttention is transformer_engine.pytorch.attention.DotProductAttention",
    "attention.multi_head_attention": "MultiheadAttention is transformer_engine.pytorch.attention.MultiheadAttention",
    **{f"optimizers.{kernel}": _ADAM_KERNEL_HINT for kernel in (
        "multi_tensor_adam", "multi_tensor_adam_fp8", "multi_tensor_adam_capturable",
        "multi_tensor_adam_capturable_master", "multi_tensor_adam_param_remainder")},
    "optimizers.multi_tensor_sgd": "a kernel of Transformer Engine's extension, which its FusedSGD launches: step "
                                   "with transformer_engine.pytorch.optimizers.FusedSGD",
}


_PROVIDED: list = []  # set by install_as_transformer_engine: what the stand-in provides, for the messages


def _describe_provided(names) -> str:
    """The stand-in's modules `names`, short: TE's one-module files under `module` as one entry."""
    pytorch = f"{ROOT}.pytorch."
    files = {f"{pytorch}module.{sub}" for sub in _MODULE_FILES} | {f"{pytorch}ops.{sub}" for sub in OPS_FILES} | {
        f"{pytorch}ops.basic.{sub}" for sub in OPS_BASIC_FILES}
    subs = [n[len(pytorch):] for n in sorted(names) if n.startswith(pytorch) and n not in files]
    return (f"{ROOT}.common.recipe, and {ROOT}.pytorch with its submodules {', '.join(subs)}, "
            f"module.<file> for each module class ({', '.join(sorted(_MODULE_FILES))}), and ops.<file> and "
            f"ops.basic.<file> for each fusible operation, as Transformer Engine's files hold them")


def _not_provided_message(module_name: str, name: str) -> str:
    """Why `name` of stand-in module `module_name` (an attribute or a submodule) is missing, and
    te-core's nearest counterpart where it has one."""
    full = f"{module_name}.{name}"
    relative = full[len(ROOT) + len(".pytorch."):] if full.startswith(ROOT + ".pytorch.") else full
    hint = EXTENSION_HINT if full.startswith(EXTENSION + ".") else (
        _NEAREST.get(relative) or _NEAREST.get(name) or _NEAREST.get(relative.rpartition(".")[0] + ".*"))
    return (f"te-core stands in for Transformer Engine here and does not provide {full!r}"
            + (f" ({hint})" if hint else "")
            + ". It provides Transformer Engine's public API: the top-level names of transformer_engine.pytorch "
            f"and the modules {_describe_provided(_PROVIDED)}; te-core's docs, 'Running Transformer Engine code "
            "on te-core', list them")


def _not_provided(module_name: str):
    """A stand-in module's __getattr__: a name Transformer Engine has and te-core does not is an
    AttributeError (so hasattr() stays False for the integrations that probe) that says so."""
    def __getattr__(attr: str):
        if attr.startswith("__"):  # the interpreter's and tools' own probes stay plain
            raise AttributeError(attr)
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}: "
                             + _not_provided_message(module_name, attr))
    return __getattr__


_BOOTSTRAP = ("<frozen importlib._bootstrap>", "importlib/_bootstrap.py", "importlib\\_bootstrap.py")


def _import_statement_context() -> Optional[str]:
    """How the import machinery is asking the finder: "fromlist" for `from <package> import
    <name>` (Python tries the name as a submodule before giving up), "import" for an import of
    the module itself (`import`, importlib.import_module), None for anything else (a probe
    such as importlib.util.find_spec, which must keep answering None)."""
    frame = sys._getframe(2)  # above this helper and find_spec: importlib's _find_spec
    seen = None
    while frame is not None and frame.f_code.co_filename.endswith(_BOOTSTRAP):
        if frame.f_code.co_name == "_find_and_load_unlocked":
            seen = "import"
        elif frame.f_code.co_name == "_handle_fromlist" and seen:
            return "fromlist"
        frame = frame.f_back
    return seen


class _NotProvidedFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path while the stand-in is installed: an import of a transformer_engine
    module under a stand-in package that te-core does not provide raises an error that says so
    (every other finder has found nothing by then: the stand-ins have no directory)."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if not _is_te_name(parent) or not _is_stand_in(parent):
            return None
        context = _import_statement_context()
        if context is None:
            return None
        message = _not_provided_message(parent, name)
        if context == "fromlist":  # what Python raises for a missing name, with the reason
            raise ImportError(f"cannot import name {name!r} from {parent!r}: {message}", name=parent)
        raise ModuleNotFoundError(f"No module named {fullname!r}: {message}", name=fullname)


_FINDER = _NotProvidedFinder()


def check_fp8_support() -> Tuple[bool, str]:
    """(available, reason) for FP8 on the selected te-core backend, as TE's check_fp8_support."""
    from ..quantization.autocast import is_fp8_available

    return is_fp8_available(return_reason=True)


def check_mxfp8_support() -> Tuple[bool, str]:
    """(native, reason) for MXFP8 GEMMs (where False, te-core still runs MXFP8, emulated)."""
    from ..quantization.autocast import is_mxfp8_available

    return is_mxfp8_available(return_reason=True)


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """(native, reason) for 1x128/128x128 block-scaled GEMMs (emulated where False)."""
    from ..quantization.autocast import is_fp8_block_scaling_available

    return is_fp8_block_scaling_available(return_reason=True)


def check_nvfp4_support() -> Tuple[bool, str]:
    """(False, reason): te-core does not run NVFP4, as TE's check_nvfp4_support answers."""
    from ..recipe import is_nvfp4_available

    return is_nvfp4_available(return_reason=True)


class FP8GlobalStateManager(GlobalStateControls):
    """The queries callers make of Transformer Engine's global FP8 state, answered from
    te-core's autocast context; te-core keeps no global state (reset and the calls that would
    mutate it: te_core.compat.fp8_state)."""

    is_fp8_available = staticmethod(check_fp8_support)
    is_mxfp8_available = staticmethod(check_mxfp8_support)
    is_fp8_block_scaling_available = staticmethod(check_fp8_block_scaling_support)
    is_nvfp4_available = staticmethod(check_nvfp4_support)

    @staticmethod
    def is_fp8_enabled() -> bool:
        from ..quantization.autocast import get_autocast_context

        context = get_autocast_context()
        return bool(context is not None and context.enabled)

    @staticmethod
    def is_fp8_calibration() -> bool:
        from ..quantization.autocast import get_autocast_context

        context = get_autocast_context()
        return bool(context is not None and context.calibrating)

    @staticmethod
    def get_fp8_recipe():
        """The innermost autocast's recipe (the object passed to it), else the default
        (DelayedScaling()), as TE."""
        from ..quantization.autocast import get_autocast_context
        from ..recipe import DelayedScaling

        context = get_autocast_context()
        if context is None:
            return DelayedScaling()
        return context.given if context.given is not None else DelayedScaling()

    @staticmethod
    def get_fp8_group():
        from ..quantization.autocast import get_autocast_context

        context = get_autocast_context()
        return None if context is None else context.amax_reduction_group

    @staticmethod
    def with_fp8_parameters() -> bool:
        from ..quantization.autocast import model_init_recipe

        return model_init_recipe() is not None


def _fp8_module(name: str) -> types.ModuleType:
    """transformer_engine.pytorch.fp8 (and its TE 2.x name, .quantization)."""
    import te_core

    from .. import recipe
    from . import te_helpers

    module = _module(name, "te-core's answers to transformer_engine.pytorch's FP8 queries")
    for attr in ("check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support",
                 "check_nvfp4_support"):
        setattr(module, attr, globals()[attr])
    module.get_fp8_te_dtype, module.get_fp8_torch_dtype = te_helpers.get_fp8_te_dtype, te_helpers.get_fp8_torch_dtype
    module.FP8GlobalStateManager = FP8GlobalStateManager
    for attr in ("autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init", "is_fp8_available",
                 "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available", "get_default_recipe",
                 "QuantizerRole"):
        setattr(module, attr, getattr(te_core, attr))
    module.get_align_size_for_quantization = te_core.quantization.get_align_size_for_quantization
    for attr in ("Recipe", "DelayedScaling", "Format", "Float8CurrentScaling", "Float8BlockScaling",
                 "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"):
        setattr(module, attr, getattr(recipe, attr))
    module.get_default_fp8_recipe = recipe.DelayedScaling
    return module


# te_core names that are not Transformer Engine's under transformer_engine.pytorch: TE's `ops` is
# its fusible-operation API (te_core.modules.fusible_ops), not te-core's op contract.
_NOT_TE_NAMES = {"ops"}


def _submodule(parent: types.ModuleType, name: str, doc: str, values: dict) -> types.ModuleType:
    module = _module(f"{parent.__name__}.{name}", doc)
    for attr, value in values.items():
        setattr(module, attr, value)
    setattr(parent, name, module)
    return module


def _names(source, names) -> dict:
    return {name: getattr(source, name) for name in names}


def _dummy_wgrads():
    cache = {}

    def get_dummy_wgrad(shape, dtype, zero: bool = False):
        """Transformer Engine's stand-in weight gradient for a weight whose gradient went into
        main_grad: one cached tensor per (shape, dtype) on the selected backend's device, zeroed
        when asked."""
        from ..backend import get_backend

        if len(shape) != 2:
            raise ValueError(f"get_dummy_wgrad: shape must be 2-D (a weight's), got {tuple(shape)}")
        key = (int(shape[0]), int(shape[1]), dtype)
        if key not in cache:
            cache[key] = torch.empty(key[:2], dtype=dtype, device=get_backend().device)
        if zero:
            cache[key].zero_()
        return cache[key].detach()

    return get_dummy_wgrad


def _optimizers_module(parent: types.ModuleType) -> None:
    """transformer_engine.pytorch.optimizers: te-core's optimizers and multi-tensor helpers, with
    Transformer Engine's files for them; its kernel names explain themselves (_NEAREST)."""
    from te_core import optimizers

    package = _submodule(parent, "optimizers", "FusedAdam, FusedSGD and the multi-tensor helpers",
                         _names(optimizers, optimizers.__all__))
    _submodule(package, "fused_adam", "FusedAdam", dict(FusedAdam=optimizers.FusedAdam))
    _submodule(package, "fused_sgd", "FusedSGD", dict(FusedSGD=optimizers.FusedSGD))
    _submodule(package, "multi_tensor_apply", "the multi-tensor applier",
               _names(optimizers, ["MultiTensorApply", "multi_tensor_applier"]))


def _ops_module(parent: types.ModuleType, fusible_ops) -> None:
    """transformer_engine.pytorch.ops, with `ops.basic` and TE's files under both (te_ops_files)."""
    ops = _submodule(parent, "ops", "Transformer Engine's fusible operations, none fused "
                     "(te_core.modules.fusible_ops)", _names(fusible_ops, fusible_ops.__all__))
    basic = _submodule(ops, "basic", "the basic operations", _names(
        fusible_ops, [cls for classes in OPS_BASIC_FILES.values() for cls in classes]))
    for package, files in ((ops, OPS_FILES), (basic, OPS_BASIC_FILES)):
        for sub, classes in files.items():
            _submodule(package, sub, ", ".join(classes), _names(fusible_ops, classes))


def _pytorch_module() -> types.ModuleType:
    import te_core
    from te_core import cpu_offload, export, modules, permutation, quantization, router
    from te_core.quantization import te_storage
    from te_core.distributed import master_weights, random, te_functions
    from te_core.modules import fusible_ops
    from te_core.modules.checkpoint import activation_recompute_forward, in_fp8_activation_recompute_phase
    from te_core.modules.checkpoint import is_fp8_activation_recompute_enabled
    from te_core.quantization import factories, factory_zoo

    from . import te_graph, te_helpers, te_inference

    module = _module(f"{ROOT}.pytorch", "te-core standing in for transformer_engine.pytorch")
    for attr in te_core.__all__:
        if attr not in _NOT_TE_NAMES:
            setattr(module, attr, getattr(te_core, attr))
    # TE's top-level names for te-core classes of other names
    module.Quantizer, module.Float8BlockwiseQTensor = quantization.Quantizer, quantization.Float8BlockwiseTensor
    module.__version__ = f"{TE_API_VERSION}+tecore.{te_core.__version__}"
    module.fp8 = _fp8_module(f"{ROOT}.pytorch.fp8")
    module.quantization = _fp8_module(f"{ROOT}.pytorch.quantization")
    _optimizers_module(module)
    _ops_module(module, fusible_ops)
    recipes = _submodule(module, "custom_recipes", "CustomRecipe's quantizer factories", {})
    _submodule(recipes, "quantizer_factories", "the built-in recipes' quantizer factories "
               "(te_core.quantization.factories)", _names(factories, factories.__all__))
    _submodule(recipes, "quantizer_factory_zoo", "mixed-precision quantizer factories; the NVFP4 ones raise "
               "(te_core.quantization.factory_zoo)", _names(factory_zoo, factory_zoo.__all__))
    _submodule(module, "distributed", "activation recompute, the RNG states tracker, collective helpers", dict(
        checkpoint=te_core.checkpoint, CudaRNGStatesTracker=te_core.CudaRNGStatesTracker,
        prepare_te_modules_for_fsdp=te_core.distributed.prepare_te_modules_for_fsdp,
        activation_recompute_forward=activation_recompute_forward,
        is_fp8_activation_recompute_enabled=is_fp8_activation_recompute_enabled,
        in_fp8_activation_recompute_phase=in_fp8_activation_recompute_phase,
        **_names(random, ["get_all_rng_states", "graph_safe_rng_available"]),
        **_names(te_functions, ["get_distributed_world_size", "gather_along_first_dim",
                                "reduce_scatter_along_first_dim", "set_tensor_model_parallel_attributes"])))
    _submodule(module, "utils", "device queries and small helpers", dict(
        _names(te_core, ["get_device_compute_capability", "get_cudnn_version", "is_bf16_available"]),
        **_names(te_helpers, ["is_bf16_compatible", "divide", "cast_if_needed", "get_default_init_method"]),
        make_weak_ref=te_graph.make_weak_ref))
    _submodule(module, "graph", "make_graphed_callables and the capture helpers around it (te_core.compat.te_graph)",
               _names(te_graph, te_graph.__all__))
    _submodule(module, "export", "the ONNX-export switch", _names(export, export.__all__))
    _submodule(module, "cpu_offload", "activation offloading to host memory", _names(cpu_offload, cpu_offload.__all__))
    tensors = dict(QuantizedTensor=quantization.QuantizedTensor, Float8Tensor=quantization.Float8Tensor,
                   MXFP8Tensor=quantization.MXFP8Tensor, Float8BlockwiseQTensor=quantization.Float8BlockwiseTensor,
                   IdentityTensor=te_core.IdentityTensor, HybridQuantizedTensor=te_core.HybridQuantizedTensor)
    tensor = _submodule(module, "tensor", "te-core's quantized tensors under Transformer Engine's names", tensors)
    quantizers = tensor_quantizers()
    # the functions TE's pickled quantized tensors call (FP8 primary weights in its checkpoints)
    rebuild = {sub: {name.rpartition(".")[2]: fn} for sub, name, fn in (
        ("float8_tensor", TE_FLOAT8_REBUILD, rebuild_te_float8_tensor),
        ("mxfp8_tensor", TE_MXFP8_REBUILD, rebuild_te_mxfp8_tensor),
        ("float8_blockwise_tensor", TE_BLOCK_REBUILD, rebuild_te_blockwise_tensor))}
    for sub, cls in (("float8_tensor", "Float8Tensor"), ("mxfp8_tensor", "MXFP8Tensor"),
                     ("float8_blockwise_tensor", "Float8BlockwiseQTensor"), ("identity_tensor", "IdentityTensor"),
                     ("hybrid_tensor", "HybridQuantizedTensor")):
        _submodule(tensor, sub, f"{cls} and its quantizers",
                   {cls: tensors[cls], **quantizers[sub], **rebuild.get(sub, {})})
        for name, quantizer in quantizers[sub].items():
            setattr(tensor, name, quantizer)
    _submodule(tensor, "utils", "the helpers of FP8 primary weights under a sharded optimizer",
               _names(master_weights, master_weights.__all__))
    _submodule(module, "constants", "DType and its torch dtype tables, the process group type", dict(
        constants(), dist_group_type=getattr(torch.distributed, "ProcessGroup", None)))
    rope = dict(RotaryPositionEmbedding=te_core.RotaryPositionEmbedding, apply_rotary_pos_emb=te_core.apply_rotary_pos_emb,
                apply_fused_qkv_rotary_pos_emb=te_core.apply_fused_qkv_rotary_pos_emb)
    attention = _submodule(module, "attention", "attention modules and rotary embeddings", dict(
        rope, DotProductAttention=te_core.DotProductAttention, MultiheadAttention=te_core.MultiheadAttention,
        InferenceParams=te_core.InferenceParams))
    _submodule(attention, "rope", "rotary position embeddings", rope)
    _submodule(attention, "inference", "the KV cache (te_core.compat.te_inference)", dict(
        InferenceParams=te_core.InferenceParams, PagedKVCacheManager=te_inference.PagedKVCacheManager))
    _submodule(module, "permutation", "MoE token permutation",
               _names(permutation, [n for n in te_core.__all__ if n.startswith("moe_")]))
    _submodule(module, "cross_entropy", "parallel_cross_entropy", dict(parallel_cross_entropy=te_core.parallel_cross_entropy))
    _submodule(module, "cpp_extensions", "general_gemm for high-precision operands (te_core.compat.te_gemm), the "
               "extension's functions te-core provides", dict(general_gemm=general_gemm, **_extension_functions()))
    _submodule(module, "router", "the MoE router functions", _names(router, router.__all__))
    module_pkg = _submodule(module, "module", "the modules", _names(modules, [
        "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "LayerNorm", "RMSNorm", "Fp8Padding",
        "Fp8Unpadding"]))
    _submodule(module_pkg, "base", "the modules' base class and helpers", dict(
        get_dummy_wgrad=_dummy_wgrads(), TransformerEngineBaseModule=modules.TransformerEngineBaseModule,
        destroy_ub=destroy_ub))
    # Transformer Engine's one-module files, where code imports a module class from its own file
    for sub, cls in _MODULE_FILES.items():
        _submodule(module_pkg, sub, cls, {cls: getattr(modules, cls)})
    _submodule(module, "transformer", "TransformerLayer", dict(TransformerLayer=te_core.TransformerLayer))
    # TE's base classes of quantized tensors and quantizers (its other names there are not provided)
    _submodule(module, "quantized_tensor", "QuantizedTensor, Quantizer and the save protocol", dict(
        QuantizedTensor=quantization.QuantizedTensor, Quantizer=quantization.Quantizer,
        prepare_for_saving=te_storage.prepare_for_saving, restore_from_saved=te_storage.restore_from_saved,
        restore_from_func_ctx=te_storage.restore_from_func_ctx))
    # TE's deprecated path to Float8Tensor (TE warns on import; the stand-in does not)
    _submodule(module, "float8_tensor", "Float8Tensor", dict(Float8Tensor=quantization.Float8Tensor))
    return module


_MODULE_FILES = {"linear": "Linear", "layernorm_linear": "LayerNormLinear", "layernorm_mlp": "LayerNormMLP",
                 "grouped_linear": "GroupedLinear", "layernorm": "LayerNorm", "rmsnorm": "RMSNorm",
                 "fp8_padding": "Fp8Padding", "fp8_unpadding": "Fp8Unpadding"}


def _extension_functions() -> dict:
    """The functions of Transformer Engine's extension te-core provides (its cpp_extensions
    re-exports them, as TE's does)."""
    return dict(thd_get_partitioned_indices=thd_get_partitioned_indices, rmsnorm_fwd=te_norm_cast.rmsnorm_fwd,
                dequantize=te_norm_cast.dequantize, device_supports_multicast=device_supports_multicast)


def _stand_in_modules(module: types.ModuleType) -> dict:
    """name -> module for `module` and every stand-in submodule under it."""
    found = {module.__name__: module}
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType) and getattr(value, "__te_core_stand_in__", False) \
                and value.__name__.startswith(module.__name__ + "."):
            found.update(_stand_in_modules(value))
    return found


def _is_te_name(name: str) -> bool:
    """Whether `name` is a module of Transformer Engine's (its package or its extension)."""
    return any(name == top or name.startswith(top + ".") for top in (ROOT, EXTENSION))


def _is_stand_in(name: str) -> bool:
    return getattr(sys.modules.get(name), "__te_core_stand_in__", False)


def install_as_transformer_engine(replace: bool = False) -> types.ModuleType:
    """Make `import transformer_engine...` resolve to te-core in this process; returns the
    stand-in for transformer_engine.pytorch. Calling it again is harmless. With a real
    Transformer Engine importable (or already imported) it raises, unless replace=True."""
    from .. import recipe

    if _is_stand_in(ROOT):
        return sys.modules[f"{ROOT}.pytorch"]
    real = ROOT in sys.modules or importlib.util.find_spec(ROOT) is not None
    if real and not replace:
        raise RuntimeError(
            "install_as_transformer_engine: a real transformer_engine package is installed or imported; "
            "te-core does not shadow it. Pass replace=True to use te-core in its place anyway."
        )
    root = _module(ROOT, "te-core standing in for Transformer Engine")
    common = _module(f"{ROOT}.common", "Transformer Engine's framework-independent part: recipes")
    pytorch = _pytorch_module()
    root.__version__ = pytorch.__version__
    root.common, root.pytorch, common.recipe = common, pytorch, recipe
    extension = _module(EXTENSION, "te-core standing in for Transformer Engine's compiled extension: DType, "
                                   "thd_get_partitioned_indices, rmsnorm_fwd, dequantize and device_supports_multicast")
    extension.DType = pytorch.DType
    for name, function in _extension_functions().items():
        setattr(extension, name, function)
    modules = {ROOT: root, f"{ROOT}.common": common, f"{ROOT}.common.recipe": recipe,
               **_stand_in_modules(pytorch), EXTENSION: extension}
    for name in [n for n in sys.modules if _is_te_name(n)]:
        del sys.modules[name]  # a replaced real package: none of its submodules may linger
    sys.modules.update(modules)
    _PROVIDED[:] = sorted(modules)
    torch.serialization.add_safe_globals(_safe_globals())
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    install_metadata(pytorch.__version__)  # integrations check the distribution before importing
    return pytorch


def _safe_globals() -> list:
    """What torch.load(weights_only=True) may call in a Transformer Engine checkpoint while the
    stand-in is installed, by TE's names, as TE registers them on import: the rebuilds of its
    pickled Float8Tensor, MXFP8Tensor and Float8BlockwiseQTensor (which check their arguments),
    the DType they are given (TE's Python enum and its extension's, both pickled as DType(int))
    and the quantizer objects pickled beside the block-scaled ones (inert records)."""
    from ..dtype import DType

    return [(rebuild_te_float8_tensor, TE_FLOAT8_REBUILD), (rebuild_te_mxfp8_tensor, TE_MXFP8_REBUILD),
            (rebuild_te_blockwise_tensor, TE_BLOCK_REBUILD), (DType, f"{EXTENSION}.DType"),
            (DType, f"{ROOT}.pytorch.constants.DType"), *((PickledQuantizer, name) for name in TE_PICKLED_QUANTIZERS)]


def uninstall_transformer_engine() -> None:
    """Remove the stand-in from sys.modules (a no-op when it is not installed)."""
    from .. import recipe

    uninstall_metadata()
    ours = set(_safe_globals())
    kept = [entry for entry in torch.serialization.get_safe_globals() if entry not in ours]
    if len(kept) != len(torch.serialization.get_safe_globals()):  # (torch has no call to remove some)
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(kept)
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if _is_te_name(n)]:
        if _is_stand_in(name) or sys.modules[name] is recipe:
            del sys.modules[name]
