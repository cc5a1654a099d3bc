"""te-core standing in for the `transformer_engine` package, opt-in.

After `te_core.install_as_transformer_engine()`, code written for Transformer Engine imports
te-core: `import transformer_engine.pytorch as te`, `transformer_engine.common.recipe`, and the
submodules integrations reach into (`transformer_engine.pytorch.fp8` / `.quantization` with
check_fp8_support, check_mxfp8_support, FP8GlobalStateManager; `.distributed.checkpoint`).
Nothing is installed on disk: the modules live in sys.modules of this process only. A real
Transformer Engine found on the path is never shadowed unless asked for (replace=True).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Tuple

import torch

from .te_metadata import install_metadata, uninstall_metadata

ROOT = "transformer_engine"
TE_API_VERSION = "2.20.0"  # the Transformer Engine release whose signatures te-core mirrors


def _module(name: str, doc: str, package: bool = True) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []  # a package: its submodules come from sys.modules, never from disk
    module.__te_core_stand_in__ = True
    module.__getattr__ = _not_provided(name)
    return module


def _not_provided(module_name: str):
    """A stand-in module's __getattr__: a name Transformer Engine has and te-core does not is an
    AttributeError (so hasattr() stays False for the integrations that probe) that says so."""
    def __getattr__(attr: str):
        if attr.startswith("__"):  # the interpreter's and tools' own probes stay plain
            raise AttributeError(attr)
        raise AttributeError(
            f"module {module_name!r} has no attribute {attr!r}: te-core stands in for Transformer Engine here "
            "and does not provide it (te-core's docs, 'Running Transformer Engine code on te-core', list "
            "what it provides)")
    return __getattr__


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


class FP8GlobalStateManager:
    """The queries callers make of Transformer Engine's global FP8 state, answered from
    te-core's autocast context (te-core keeps no global state to reset or mutate)."""

    is_fp8_available = staticmethod(check_fp8_support)
    is_mxfp8_available = staticmethod(check_mxfp8_support)
    is_fp8_block_scaling_available = staticmethod(check_fp8_block_scaling_support)

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
        """The innermost autocast's recipe, else the default (DelayedScaling()), as TE."""
        from ..quantization.autocast import get_autocast_context
        from ..recipe import DelayedScaling

        context = get_autocast_context()
        return context.recipe if context is not None else DelayedScaling()

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

    module = _module(name, "te-core's answers to transformer_engine.pytorch's FP8 queries", package=False)
    for attr in ("check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support"):
        setattr(module, attr, globals()[attr])
    module.FP8GlobalStateManager = FP8GlobalStateManager
    for attr in ("autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init", "is_fp8_available",
                 "is_mxfp8_available", "is_fp8_block_scaling_available", "get_default_recipe"):
        setattr(module, attr, getattr(te_core, attr))
    for attr in ("Recipe", "DelayedScaling", "Format", "Float8CurrentScaling", "Float8BlockScaling",
                 "MXFP8BlockScaling"):
        setattr(module, attr, getattr(recipe, attr))
    module.get_default_fp8_recipe = recipe.DelayedScaling
    return module


# te_core names that are not Transformer Engine's under transformer_engine.pytorch: TE's `ops` is
# its fusible-operation API, not te-core's op contract.
_NOT_TE_NAMES = {"ops"}


def _submodule(parent: types.ModuleType, name: str, doc: str, values: dict, package: bool = False) -> types.ModuleType:
    module = _module(f"{parent.__name__}.{name}", doc, package=package)
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


def _pytorch_module() -> types.ModuleType:
    import te_core
    from te_core import cpu_offload, modules, permutation, quantization, router
    from te_core.modules.checkpoint import activation_recompute_forward

    module = _module(f"{ROOT}.pytorch", "te-core standing in for transformer_engine.pytorch")
    for attr in te_core.__all__:
        if attr not in _NOT_TE_NAMES:
            setattr(module, attr, getattr(te_core, attr))
    module.__version__ = f"{TE_API_VERSION}+tecore.{te_core.__version__}"
    module.fp8 = _fp8_module(f"{ROOT}.pytorch.fp8")
    module.quantization = _fp8_module(f"{ROOT}.pytorch.quantization")
    _submodule(module, "distributed", "checkpoint() for activation recompute, the RNG states tracker", dict(
        checkpoint=te_core.checkpoint, CudaRNGStatesTracker=te_core.CudaRNGStatesTracker,
        activation_recompute_forward=activation_recompute_forward))
    _submodule(module, "cpu_offload", "activation offloading to host memory", _names(cpu_offload, cpu_offload.__all__))
    tensors = dict(QuantizedTensor=quantization.QuantizedTensor, Float8Tensor=quantization.Float8Tensor,
                   MXFP8Tensor=quantization.MXFP8Tensor, Float8BlockwiseQTensor=quantization.Float8BlockwiseTensor)
    tensor = _submodule(module, "tensor", "te-core's quantized tensors under Transformer Engine's names", tensors,
                        package=True)
    for sub, cls in (("float8_tensor", "Float8Tensor"), ("mxfp8_tensor", "MXFP8Tensor"),
                     ("float8_blockwise_tensor", "Float8BlockwiseQTensor")):
        _submodule(tensor, sub, f"{cls}", {cls: tensors[cls]})
    rope = dict(RotaryPositionEmbedding=te_core.RotaryPositionEmbedding, apply_rotary_pos_emb=te_core.apply_rotary_pos_emb,
                apply_fused_qkv_rotary_pos_emb=te_core.apply_fused_qkv_rotary_pos_emb)
    attention = _submodule(module, "attention", "attention modules and rotary embeddings", dict(
        rope, DotProductAttention=te_core.DotProductAttention, MultiheadAttention=te_core.MultiheadAttention,
        InferenceParams=te_core.InferenceParams), package=True)
    _submodule(attention, "rope", "rotary position embeddings", rope)
    _submodule(module, "permutation", "MoE token permutation",
               _names(permutation, [n for n in te_core.__all__ if n.startswith("moe_")]))
    _submodule(module, "cross_entropy", "parallel_cross_entropy", dict(parallel_cross_entropy=te_core.parallel_cross_entropy))
    _submodule(module, "router", "the MoE router functions", _names(router, router.__all__))
    module_pkg = _submodule(module, "module", "the modules", _names(modules, [
        "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "LayerNorm", "RMSNorm", "Fp8Padding",
        "Fp8Unpadding"]), package=True)
    _submodule(module_pkg, "base", "module helpers", dict(get_dummy_wgrad=_dummy_wgrads()))
    return module


def _stand_in_modules(module: types.ModuleType) -> dict:
    """name -> module for `module` and every stand-in submodule under it."""
    found = {module.__name__: module}
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType) and getattr(value, "__te_core_stand_in__", False) \
                and value.__name__.startswith(module.__name__ + "."):
            found.update(_stand_in_modules(value))
    return found


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
    modules = {ROOT: root, f"{ROOT}.common": common, f"{ROOT}.common.recipe": recipe,
               f"{ROOT}.pytorch.optimizers": pytorch.optimizers, **_stand_in_modules(pytorch)}
    for name in [n for n in sys.modules if n == ROOT or n.startswith(ROOT + ".")]:
        del sys.modules[name]  # a replaced real package: none of its submodules may linger
    sys.modules.update(modules)
    install_metadata(pytorch.__version__)  # integrations check the distribution before importing
    return pytorch


def uninstall_transformer_engine() -> None:
    """Remove the stand-in from sys.modules (a no-op when it is not installed)."""
    from .. import optimizers, recipe

    uninstall_metadata()
    for name in [n for n in sys.modules if n == ROOT or n.startswith(ROOT + ".")]:
        if _is_stand_in(name) or sys.modules[name] is recipe or sys.modules[name] is optimizers:
            del sys.modules[name]
