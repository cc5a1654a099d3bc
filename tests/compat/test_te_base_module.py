"""transformer_engine.pytorch.module.base.TransformerEngineBaseModule (te_core.modules._te_base):
te-core's modules are instances of it, and the members ported code (Megatron-LM's FSDP and
CUDA-graph code) reads on it answer from te-core's state or refuse clearly."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling


def _te_modules():
    return [te.Linear(16, 16), te.LayerNormLinear(16, 16), te.LayerNormMLP(16, 32), te.GroupedLinear(2, 16, 16),
            te.DotProductAttention(2, 8)]


def test_te_cores_modules_are_instances(stand_in):
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in _te_modules():
        assert isinstance(module, TransformerEngineBaseModule), type(module).__name__
        assert callable(module.set_tensor_parallel_group)
    # as in Transformer Engine: norms and containers are not (their GEMM submodules are)
    assert not isinstance(te.LayerNorm(16), TransformerEngineBaseModule)
    layer = te.TransformerLayer(16, 32, 2)
    assert not isinstance(layer, TransformerEngineBaseModule)
    assert {type(m).__name__ for m in layer.modules() if isinstance(m, TransformerEngineBaseModule)} == {
        "LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention"}

    class MegatronStyle(te.Linear):  # Megatron-LM's TELinear subclasses TE's module classes
        pass

    assert isinstance(MegatronStyle(16, 16), TransformerEngineBaseModule)


def test_fp8_meta_follows_the_modules_state():
    linear = te.Linear(16, 16)
    assert set(linear.fp8_meta) == {"recipe", "fp8_checkpoint", "fp8_group"}
    assert isinstance(linear.fp8_meta["recipe"], DelayedScaling) and linear.fp8_meta["fp8_checkpoint"] is False
    current = Float8CurrentScaling()
    with te.autocast(recipe=current):
        assert linear.fp8_meta["recipe"] is current  # before its first forward: the active autocast's
    delayed = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
    with te.autocast(recipe=delayed):
        linear(torch.randn(8, 16)).sum().backward()
    assert linear.fp8_meta["recipe"] == delayed and linear.fp8_meta["fp8_checkpoint"] is True
    assert linear.fp8_meta["fp8_group"] is None
    with te.autocast(recipe=current), pytest.warns(UserWarning, match="Recipe type changed"):
        linear(torch.randn(8, 16))  # a recipe without state: nothing to checkpoint
    assert linear.fp8_meta["recipe"] == current and linear.fp8_meta["fp8_checkpoint"] is False


def test_fp8_meta_refuses_writes_and_unknown_keys():
    linear = te.Linear(16, 16)
    with pytest.raises(TypeError, match="Linear.fp8_meta is a read-only view in te-core.*te.autocast.*'fp8_group'"):
        linear.fp8_meta["fp8_group"] = None
    with pytest.raises(KeyError, match="has no 'scaling_fwd' in te-core.*quantization_state"):
        linear.fp8_meta["scaling_fwd"]


def test_fp8_primary_weights_for_megatron_fsdp():
    """Megatron-FSDP's meta-device init: param_init_meta[name].fp8_meta_index marks the FP8
    primary weights of a module with primary_weights_in_fp8, and fp8_meta['recipe'].mxfp8() says
    whether they keep column-wise data."""
    plain = te.LayerNormMLP(32, 64)
    assert plain.primary_weights_in_fp8 is False
    assert all(meta.fp8_meta_index is None for meta in plain.param_init_meta.values())
    recipe = MXFP8BlockScaling()
    with te.quantized_model_init(enabled=True, recipe=recipe):
        mlp, linear = te.LayerNormMLP(32, 64), te.Linear(32, 32)
    assert mlp.primary_weights_in_fp8 is True and mlp.fp8_meta["recipe"].mxfp8()
    marked = {name for name, p in mlp.named_parameters(recurse=False)
              if mlp.param_init_meta[name].fp8_meta_index is not None}
    assert marked == {"fc1_weight", "fc2_weight"}
    assert all(isinstance(getattr(mlp, name), te.QuantizedTensor) for name in marked)
    # the weight's quantizer among the forward ones (input, weight, ...), an int as in TE
    assert linear.param_init_meta["weight"].fp8_meta_index == 1
    assert linear.param_init_meta["bias"].fp8_meta_index is None


def test_init_fp8_metadata_has_nothing_to_prepare():
    grouped = te.GroupedLinear(3, 16, 16)
    grouped.init_fp8_metadata(num_gemms=3)  # Megatron-LM's TEGroupedLinear calls it before each load
    te.Linear(16, 16).init_fp8_metadata()
    with pytest.raises(ValueError, match="num_gemms=2, but the module runs 3 GEMM"):
        grouped.init_fp8_metadata(num_gemms=2)


def test_fp8_and_fp8_calibration_follow_the_last_forward():
    linear = te.Linear(16, 16)
    assert linear.fp8 is False and linear.fp8_calibration is False  # before any forward, as TE's
    x = torch.randn(8, 16)
    with te.autocast(recipe=DelayedScaling()):
        linear(x)
    assert linear.fp8 is True and linear.fp8_calibration is False
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        linear(x)
    assert linear.fp8 is False and linear.fp8_calibration is True
    linear(x)
    assert linear.fp8 is False and linear.fp8_calibration is False
    assert te.DotProductAttention(2, 8).fp8 is False


class _MegatronGroupedLinear(te.GroupedLinear):
    """Megatron-LM's TEGroupedLinear dist-checkpoint path (megatron/core/extensions/
    transformer_engine.py: merge_extra_states, _encode_extra_state, _decode_extra_state,
    _split_extra_state), its TE >= 2.0 branches copied as written, with pickle.Unpickler in place
    of its SafeUnpickler (an allow-list of the same classes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._register_load_state_dict_pre_hook(_MegatronGroupedLinear.merge_extra_states, with_module=True)

    def merge_extra_states(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                           error_msgs):
        self.init_fp8_metadata(num_gemms=self.num_gemms)
        fp8_checkpoint = any("_extra_state" in str(key) for key in state_dict.keys())
        if not fp8_checkpoint:
            return
        try:
            state_list = [state_dict.pop(f"{prefix}_extra_state{i}") for i in range(1, self.num_gemms)]
        except KeyError:
            return
        if (not state_dict or not state_list or state_dict.get(f"{prefix}_extra_state") is None
                or self._decode_extra_state(state_dict[f"{prefix}_extra_state"]) is None):
            return
        raise AssertionError("a te-core state without delayed scaling decodes to None: not reached")

    def _encode_extra_state(self, state):
        import pickle

        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def _decode_extra_state(self, state):
        import io
        import pickle

        if isinstance(state, torch.Tensor):
            if state.numel() == 0:
                return
            return pickle.Unpickler(io.BytesIO(state.detach().cpu().numpy().tobytes())).load()
        raise RuntimeError("Unsupported checkpoint format.")

    def _split_extra_state(self, state):
        fp8_checkpoint = self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration
        if not fp8_checkpoint:
            return [state] * self.num_gemms
        state = self._decode_extra_state(state)
        if state is None:
            return [torch.empty(0, dtype=torch.uint8)] * self.num_gemms
        raise AssertionError("a te-core state without delayed scaling decodes to None: not reached")

    def megatron_dist_checkpoint(self) -> dict:
        """The per-expert entries _sharded_state_dict_grouped saves, by their keys there."""
        full = self.state_dict(prefix="", keep_vars=True)
        extra_states = self._split_extra_state(full["_extra_state"])
        saved = {}
        for gemm_idx in range(self.num_gemms):
            saved[f"weight{gemm_idx}"] = full[f"weight{gemm_idx}"].detach().clone()
            saved[f"bias{gemm_idx}"] = full[f"bias{gemm_idx}"].detach().clone()
            saved[f"_extra_state{'' if gemm_idx == 0 else gemm_idx}"] = extra_states[gemm_idx]
        return saved


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling(), MXFP8BlockScaling()])
def test_megatron_grouped_linear_dist_checkpoint_round_trip(recipe):
    """Megatron splits a GroupedLinear's extra state per expert on save and merges it on load; it
    reads fp8 / fp8_calibration to decide whether there is FP8 state to split. With no FP8 or a
    recipe that keeps no scaling state, te-core's (empty) extra state goes through unchanged."""
    torch.manual_seed(4)
    source = _MegatronGroupedLinear(3, 32, 32)
    x, splits = torch.randn(96, 32), [32, 32, 32]
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        expected = source(x, splits)
    assert source.fp8 is (recipe is not None)
    saved = source.megatron_dist_checkpoint()
    assert {k for k in saved if "_extra_state" in k} == {"_extra_state", "_extra_state1", "_extra_state2"}
    target = _MegatronGroupedLinear(3, 32, 32)
    target.load_state_dict(saved, strict=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        torch.testing.assert_close(target(x, splits), expected, rtol=0, atol=0)
