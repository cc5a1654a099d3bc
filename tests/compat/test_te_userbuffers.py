"""Transformer Engine's userbuffers entry points and its expert-parallel module under the stand-in:
a tensor-parallel script with communication overlap switched off runs as written (it asks
device_supports_multicast() on import and calls destroy_ub() at its end), while initialize_ub and
transformer_engine.pytorch.ep, which te-core has no counterpart of, fail at once with errors that
say what to run instead."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

FP32 = dict(rtol=1.3e-6, atol=1e-5)


def test_overlap_switched_off_runs_as_written(stand_in):
    import transformer_engine.pytorch.cpp_extensions as cpp
    import transformer_engine_torch as tex

    te = stand_in
    assert tex.device_supports_multicast() is False and cpp.device_supports_multicast(0) is False
    with pytest.raises(TypeError, match="device_id must be an int"):
        tex.device_supports_multicast("cuda:0")
    torch.manual_seed(0)
    layer = te.Linear(48, 32, params_dtype=torch.float32, ub_overlap_rs=False, ub_overlap_ag=False, ub_name="proj")
    x = torch.randn(6, 48)
    torch.testing.assert_close(layer(x), F.linear(x.double(), layer.weight.double(), layer.bias.double()).float(),
                               **FP32)
    assert te.module.base.destroy_ub() is None  # nothing was made: it returns quietly, as TE's does
    te.module.base.destroy_ub()


def test_userbuffers_and_expert_parallel_modules_say_what_to_use_instead(stand_in):
    te = stand_in
    with pytest.raises(AttributeError, match="drop the initialize_ub call and leave the modules' ub_tp_comm_overlap"):
        te.module.base.initialize_ub([64, 32], 2)
    assert not hasattr(te.module.base, "initialize_ub")  # integrations probing for overlap see it missing
    with pytest.raises(AttributeError, match="UserBufferQuantizationMode.*not supported by te-core"):
        te.module.base.UserBufferQuantizationMode
    with pytest.raises(ModuleNotFoundError, match="transformer_engine.pytorch.ep.*all_to_all_single.*moe_permute"
                                                  ".*GroupedLinear"):
        from transformer_engine.pytorch.ep import EpBuffer  # noqa: F401
