"""transformer_engine.pytorch.graph (te_core.compat.te_graph): what Megatron-LM's CUDA-graph code
imports from it, on te-core's graph capture."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format


def _megatron_import_block() -> bool:
    """Megatron-LM's import block of its CUDA-graph code (megatron/core/transformer/cuda_graphs.py),
    as written: its TE path is on only if every name imports."""
    try:
        import transformer_engine as te_  # noqa: F401
        from transformer_engine.pytorch.distributed import is_fp8_activation_recompute_enabled  # noqa: F401
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: F401
        from transformer_engine.pytorch.graph import (  # noqa: F401
            make_graphed_callables,
            restore_fp8_tensors,
            save_fp8_tensors,
        )
        from transformer_engine.pytorch.graph import set_capture_end as te_set_capture_end  # noqa: F401
        from transformer_engine.pytorch.graph import set_capture_start as te_set_capture_start  # noqa: F401
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule  # noqa: F401
        from transformer_engine.pytorch.utils import make_weak_ref  # noqa: F401

        return True
    except:  # noqa: E722 (Megatron's own bare except)
        return False


def test_megatrons_graph_imports_resolve(stand_in):
    assert _megatron_import_block()
    from transformer_engine.pytorch.graph import make_graphed_callables

    assert make_graphed_callables is te.make_graphed_callables


def test_capture_start_and_end_bracket_capture_mode(stand_in):
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.graph import is_graph_capturing, set_capture_end, set_capture_start

    from te_core.quantization.scaling import graph_capture_active

    assert not is_graph_capturing() and not graph_capture_active()
    set_capture_start()
    try:
        set_capture_start()  # again: still one capture, ended by one set_capture_end (TE's flag)
        assert is_graph_capturing() and graph_capture_active() and FP8GlobalStateManager.fp8_graph_capturing()
    finally:
        set_capture_end()
    assert not is_graph_capturing() and not graph_capture_active()
    set_capture_end()  # without a start: nothing to end
    assert not graph_capture_active()


def test_no_backward_scale_update_is_queued_while_capturing(stand_in):
    """Between set_capture_start and set_capture_end the modules run as in te-core's own capture: a
    captured backward must not carry a scale update (the caller's replay loop does the updates)."""
    from transformer_engine.pytorch.graph import set_capture_end, set_capture_start

    torch.manual_seed(0)
    linear = te.Linear(32, 32)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    with te.autocast(recipe=recipe):
        linear(torch.randn(16, 32)).sum().backward()
    backward = linear.quantization_state()["backward"]["grad_output"]
    before = backward["scale"].clone()
    set_capture_start()
    try:
        with te.autocast(recipe=recipe):
            (linear(torch.randn(16, 32)) * 1e3).sum().backward()
    finally:
        set_capture_end()
    torch.testing.assert_close(backward["scale"], before, rtol=0, atol=0)
    with te.autocast(recipe=recipe):  # outside: the update runs again
        (linear(torch.randn(16, 32)) * 1e3).sum().backward()
    assert not torch.equal(backward["scale"], before)


def _state(module):
    return {d: {s: {k: v.clone() for k, v in t.items()} for s, t in slots.items()}
            for d, slots in module.quantization_state().items()}


def test_save_and_restore_fp8_tensors_put_the_scaling_state_back(stand_in):
    from transformer_engine.pytorch.graph import restore_fp8_tensors, save_fp8_tensors

    torch.manual_seed(1)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    model = torch.nn.Sequential(te.Linear(32, 64), torch.nn.GELU(), te.Linear(64, 32))
    late = te.Linear(32, 32)  # no scaling state yet when saved: the warm-up makes it
    with te.autocast(recipe=recipe):
        model(torch.randn(16, 32)).sum().backward()
    saved_state = [_state(m) for m in model if isinstance(m, te.Linear)]
    live = model[0].quantization_state()["forward"]["input"]["amax_history"].data_ptr()
    saved = save_fp8_tensors([model, late], recipe)
    for _ in range(2):  # warm-up passes move the state on
        with te.autocast(recipe=recipe):
            late(model(torch.randn(16, 32) * 7)).sum().backward()
    history = model[0].quantization_state()["forward"]["input"]["amax_history"]
    assert not torch.equal(history, saved_state[0]["forward"]["input"]["amax_history"])
    restore_fp8_tensors([model, late], saved)
    for module, expected in zip([m for m in model if isinstance(m, te.Linear)], saved_state):
        for direction, slots in expected.items():
            for slot, tensors in slots.items():
                for key, value in tensors.items():
                    restored = module.quantization_state()[direction][slot][key]
                    torch.testing.assert_close(restored, value, rtol=0, atol=0)
    assert model[0].quantization_state()["forward"]["input"]["amax_history"].data_ptr() == live  # in place
    for slots in late.quantization_state().values():
        for tensors in slots.values():
            assert torch.all(tensors["amax_history"] == 0) and torch.all(tensors["scale"] == 1)


def test_save_fp8_tensors_answers_none_without_delayed_scaling(stand_in):
    from transformer_engine.pytorch.graph import restore_fp8_tensors, save_fp8_tensors

    linear = te.Linear(16, 16)
    assert save_fp8_tensors([linear], Float8CurrentScaling()) is None and save_fp8_tensors([linear], None) is None
    restore_fp8_tensors([linear], None)
    with pytest.raises(TypeError, match="pass the recipe .*not an amax history length"):
        save_fp8_tensors([linear], 16)
    with pytest.raises(TypeError, match="must be torch.nn.Modules.*got str"):
        save_fp8_tensors(["linear"], DelayedScaling())
    saved = save_fp8_tensors([linear], DelayedScaling())
    with pytest.raises(RuntimeError, match="what save_fp8_tensors returned for these 2 module.*a list of 1"):
        restore_fp8_tensors([linear, te.Linear(16, 16)], saved)


def test_make_weak_ref_keeps_the_values(stand_in):
    from transformer_engine.pytorch.utils import make_weak_ref

    x = torch.randn(4, 4)
    assert make_weak_ref(x) is x
    nested = make_weak_ref({"a": (x, [x, None]), "b": 3, "c": 1.5, "d": True})
    assert nested["a"][0] is x and nested["a"][1] == [x, None] and isinstance(nested["a"], tuple)
    assert (nested["b"], nested["c"], nested["d"]) == (3, 1.5, True)
    with pytest.raises(TypeError, match="make_weak_ref: got a str"):
        make_weak_ref("x")


def test_graph_pool_handle_says_when_the_device_has_no_graphs(stand_in):
    from transformer_engine.pytorch.graph import graph_pool_handle

    with pytest.raises(NotImplementedError, match="no graph capture for device type 'cpu'"):
        graph_pool_handle()
