"""Transformer Engine's helper functions that Megatron-LM and NeMo import, under the stand-in:
the distributed ones (world size, gather and reduce-scatter along the first dimension on 2 gloo
ranks, compared with the concatenation and sum computed directly; the tensor-parallel
attributes; the recompute and RNG queries), utils', the FP8 dtype queries of each recipe,
constants.dist_group_type and the CPU-offload queries."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

import te_core as te
from te_core.dtype import DType
from te_core.quantization import te_quantizers
from te_core.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from te_core.distributed.te_functions import (
    gather_along_first_dim,
    get_distributed_world_size,
    reduce_scatter_along_first_dim,
)

# tests/ is on sys.path (pytest puts the directory above a test package there): the gloo pool of
# tests/distributed
from distributed._pool import pool_of


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def test_the_names_resolve_to_te_core(stand_in):
    from transformer_engine.pytorch import cpu_offload, distributed, fp8, quantization, utils
    from transformer_engine.pytorch.constants import dist_group_type

    from te_core import cpu_offload as offload
    from te_core.compat import te_helpers
    from te_core.distributed import random, te_functions

    recompute = importlib.import_module("te_core.modules.checkpoint")  # (te_core.modules.checkpoint: the function)
    for name in ("get_distributed_world_size", "gather_along_first_dim", "reduce_scatter_along_first_dim",
                 "set_tensor_model_parallel_attributes"):
        assert getattr(distributed, name) is getattr(te_functions, name)
    for name in ("get_all_rng_states", "graph_safe_rng_available"):
        assert getattr(distributed, name) is getattr(random, name)
    for name in ("is_fp8_activation_recompute_enabled", "in_fp8_activation_recompute_phase"):
        assert getattr(distributed, name) is getattr(recompute, name)
    for name in ("is_bf16_compatible", "divide", "cast_if_needed", "get_default_init_method"):
        assert getattr(utils, name) is getattr(te_helpers, name)
    for module in (fp8, quantization):
        assert module.get_fp8_te_dtype is te_helpers.get_fp8_te_dtype
        assert module.get_fp8_torch_dtype is te_helpers.get_fp8_torch_dtype
    assert cpu_offload.is_cpu_offload_enabled is offload.is_cpu_offload_enabled
    assert cpu_offload.mark_activation_offload is offload.mark_activation_offload
    assert dist_group_type is dist.ProcessGroup
    # Megatron-LM's distributed optimizer with --fp8-param-gather (tests/distributed/test_master_weights.py)
    from transformer_engine.pytorch.tensor import utils as tensor_utils

    from te_core.distributed import master_weights

    for name in ("replace_raw_data", "quantize_master_weights", "cast_master_weights_to_fp8",
                 "post_all_gather_processing", "clear_columnwise_cache", "is_custom"):
        assert getattr(tensor_utils, name) is getattr(master_weights, name)


# ------------------------------------------------------------------ collectives on 2 gloo ranks
def _per_rank(shape, rank, world, seed, dtype=torch.float32):
    everyone = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)).to(dtype) for r in range(world)]
    return everyone, everyone[rank].clone()


def check_gather_and_reduce_scatter(ctx):
    group, rank = ctx.group(2), ctx.rank
    assert get_distributed_world_size(group) == 2 and get_distributed_world_size() == 2
    for dtype in (torch.float32, torch.bfloat16):
        xs, x = _per_rank((4, 3, 2), rank, 2, seed=0, dtype=dtype)
        out, handle = gather_along_first_dim(x, group)
        assert handle is None and out.dtype == dtype and torch.equal(out, torch.cat(xs))
        out, handle = gather_along_first_dim(x, group, async_op=True)
        handle.wait()
        assert torch.equal(out, torch.cat(xs))
        given = torch.full((8, 3, 2), float("nan"), dtype=dtype)
        out, _ = gather_along_first_dim(x, group, output_tensor=given)
        assert out is given and torch.equal(given, torch.cat(xs))

        out, handle = reduce_scatter_along_first_dim(x, group)
        assert handle is None and out.shape == (2, 3, 2)
        torch.testing.assert_close(out, (xs[0].float() + xs[1].float()).to(dtype).chunk(2)[rank])
        out, handle = reduce_scatter_along_first_dim(x, group, async_op=True)
        handle.wait()
        torch.testing.assert_close(out, (xs[0].float() + xs[1].float()).to(dtype).chunk(2)[rank])
    with pytest.raises(ValueError, match=r"first dimension \(3\) must be divisible by the group's size 2"):
        reduce_scatter_along_first_dim(torch.ones(3, 2), group)
    with pytest.raises(ValueError, match="the given output tensor is"):
        gather_along_first_dim(torch.ones(2, 2), group, output_tensor=torch.empty(3, 2))
    return True


def check_quantized_gathers(ctx):
    group, rank = ctx.group(2), ctx.rank
    xs, x = _per_rank((4, 32), rank, 2, seed=10)
    same = te_quantizers.Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), DType.kFloat8E4M3)
    shards = [same(t) for t in xs]  # what each rank quantized, computed here on every rank
    out, handle = gather_along_first_dim(shards[rank], group)
    assert handle is None and isinstance(out, te.Float8Tensor) and out.shape == (8, 32)
    assert torch.equal(out.dequantize(), torch.cat([s.dequantize() for s in shards]))
    own = te_quantizers.Float8Quantizer(torch.tensor([1.0 + rank]), torch.zeros(1), DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="different scales"):
        gather_along_first_dim(own(x), group)
    mx = te_quantizers.MXFP8Quantizer(DType.kFloat8E4M3)(torch.randn(32, 32))
    with pytest.raises(NotImplementedError, match="not MXFP8Tensor"):
        gather_along_first_dim(mx, group)
    with pytest.raises(NotImplementedError, match="quantizer"):
        gather_along_first_dim(x, group, quantizer=same)
    with pytest.raises(NotImplementedError, match="reduce-scatter inp.dequantize"):
        reduce_scatter_along_first_dim(shards[rank], group)
    return True


def test_gather_and_reduce_scatter_match_the_direct_computation(pool):
    assert pool.run(check_gather_and_reduce_scatter) == [True, True]


def test_float8_tensors_gather_as_fp8_and_other_quantized_tensors_say_what_to_do(pool):
    assert pool.run(check_quantized_gathers) == [True, True]


def test_a_single_process_is_a_group_of_one():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    x = torch.randn(3, 2)
    assert get_distributed_world_size() == 1
    assert gather_along_first_dim(x, None) == (x, None) and reduce_scatter_along_first_dim(x, None) == (x, None)


# ------------------------------------------------------------------ attributes, recompute, RNG
def test_tensor_model_parallel_attributes_are_set_once(stand_in):
    from transformer_engine.pytorch.distributed import set_tensor_model_parallel_attributes

    weight = torch.nn.Parameter(torch.empty(4, 4))
    set_tensor_model_parallel_attributes(weight, True, 1, 1)
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (True, 1, 1)
    with pytest.raises(RuntimeError, match="already has 'tensor_model_parallel' set"):
        set_tensor_model_parallel_attributes(weight, False, 0, 1)
    layer = te.Linear(8, 8, parallel_mode="column", tp_size=2)  # te-core's modules mark their weights alike
    with pytest.raises(RuntimeError, match="already has"):
        set_tensor_model_parallel_attributes(layer.weight, True, 0, 1)


def test_recompute_queries_follow_the_region_and_its_phase(stand_in):
    from transformer_engine.pytorch.distributed import (
        activation_recompute_forward,
        in_fp8_activation_recompute_phase,
        is_fp8_activation_recompute_enabled,
    )

    layer = te.Linear(16, 16)
    seen = []

    def block(x):
        seen.append((is_fp8_activation_recompute_enabled(), in_fp8_activation_recompute_phase()))
        return layer(x)

    x = torch.randn(16, 16, requires_grad=True)
    assert (is_fp8_activation_recompute_enabled(), in_fp8_activation_recompute_phase()) == (False, False)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        assert is_fp8_activation_recompute_enabled() is False  # FP8 on, but no recompute region
        y = te.checkpoint(block, x)
    y.sum().backward()  # the recompute runs here, outside te.autocast: it still counts as FP8
    y = te.checkpoint(block, x)
    y.sum().backward()
    assert seen == [(True, False), (True, True), (False, False), (False, True)]
    assert (is_fp8_activation_recompute_enabled(), in_fp8_activation_recompute_phase()) == (False, False)
    with activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        assert in_fp8_activation_recompute_phase() is True
    with activation_recompute_forward(activation_recompute=False, recompute_phase=True):
        assert in_fp8_activation_recompute_phase() is False  # not a recompute region at all


def test_rng_queries_show_the_last_trackers_states(stand_in):
    from transformer_engine.pytorch.distributed import (
        CudaRNGStatesTracker,
        get_all_rng_states,
        graph_safe_rng_available,
    )

    assert graph_safe_rng_available() is False  # states are tensors, never graph-safe generators
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    states = get_all_rng_states()
    assert list(states) == ["model-parallel-rng"] and torch.equal(states["model-parallel-rng"],
                                                                  tracker.get_states()["model-parallel-rng"])
    before = states["model-parallel-rng"].clone()
    with tracker.fork():
        torch.rand(4)
    assert not torch.equal(get_all_rng_states()["model-parallel-rng"], before)  # the fork's advance shows through
    other = CudaRNGStatesTracker()
    other.set_states({"data-parallel-rng": before})
    assert list(get_all_rng_states()) == ["data-parallel-rng"]


# ------------------------------------------------------------------ utils, dtypes, constants, offload
def test_utils_helpers(stand_in):
    from transformer_engine.pytorch.utils import (
        cast_if_needed,
        divide,
        get_default_init_method,
        is_bf16_available,
        is_bf16_compatible,
    )

    assert is_bf16_compatible() is is_bf16_available()
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="divide: 10 is not divisible by 4 \\(remainder 2\\)"):
        divide(10, 4)
    with pytest.raises(ValueError, match="cannot divide 10 by 0"):
        divide(10, 0)
    x = torch.randn(3, 4)
    assert cast_if_needed(None, torch.bfloat16) is None and cast_if_needed(x, torch.float32) is x
    weight = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        cast = cast_if_needed(weight, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and cast.grad_fn is not None  # recorded despite no_grad, as in TE
    torch.manual_seed(0)
    w = torch.empty(256, 256)
    get_default_init_method()(w)
    assert abs(w.mean().item()) < 2e-3 and abs(w.std().item() - 0.023) < 1e-3


@pytest.mark.parametrize("recipe, forward, backward", [
    (DelayedScaling(), torch.float8_e4m3fn, torch.float8_e5m2),
    (DelayedScaling(fp8_format=Format.E4M3), torch.float8_e4m3fn, torch.float8_e4m3fn),
    (Float8CurrentScaling(), torch.float8_e4m3fn, torch.float8_e5m2),
    (Float8BlockScaling(), torch.float8_e4m3fn, torch.float8_e4m3fn),
    (MXFP8BlockScaling(), torch.float8_e4m3fn, torch.float8_e4m3fn),
    (NVFP4BlockScaling(), torch.float8_e4m3fn, torch.float8_e4m3fn),  # (its scales' format, as in TE)
])
def test_fp8_dtype_queries(stand_in, recipe, forward, backward):
    from transformer_engine.pytorch.fp8 import get_fp8_te_dtype, get_fp8_torch_dtype

    assert get_fp8_torch_dtype(recipe) == forward and get_fp8_torch_dtype(recipe, fprop_tensor=False) == backward
    assert get_fp8_te_dtype(recipe) is DType.cast(forward)
    assert get_fp8_te_dtype(recipe, False) is DType.cast(backward)


def test_fp8_dtype_queries_need_a_recipe():
    from te_core.compat.te_helpers import get_fp8_torch_dtype

    with pytest.raises(TypeError, match="expected a recipe with an fp8_format"):
        get_fp8_torch_dtype("hybrid")


def test_cpu_offload_queries(stand_in):
    from transformer_engine.pytorch.cpu_offload import (
        get_cpu_offload_context,
        is_cpu_offload_enabled,
        mark_activation_offload,
    )

    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    mark_activation_offload(x, None)  # accepted and nothing to do
    assert is_cpu_offload_enabled() is False
    disabled, _ = get_cpu_offload_context(enabled=False)
    with disabled:
        assert is_cpu_offload_enabled() is False
    context, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    for _ in range(3):
        with context:
            assert is_cpu_offload_enabled() is True
            x = layer(x)
        x = sync(x)
        assert is_cpu_offload_enabled() is False
    x.sum().backward()
