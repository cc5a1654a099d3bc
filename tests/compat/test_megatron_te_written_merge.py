"""A distributed checkpoint that Transformer Engine and Megatron-LM wrote (TEGroupedLinear under
DelayedScaling, one `_extra_state{g}` entry per expert in TE's pickle, TE's recipe object in each)
loads into te-core's GroupedLinear through Megatron-LM's merge_extra_states pre-hook.

The merge unpickles the entries through the stand-in (TE's recipe names resolve to te-core's
classes), assigns the recipe to fp8_meta["recipe"] and pickles the merged state again: it then
names te_core.recipe's DelayedScaling, Format and _FormatHelper, which te-core's reader of TE
state takes as inert records, as it takes TE's own.

TE keeps a GroupedLinear's columns GEMM by GEMM (GEMM g's input, weight and output at 3g, 3g+1,
3g+2; grad output and grad input at 2g, 2g+1). Megatron-LM's split slices `view(3, -1)[:, g]` and
its merge concatenates `view(-1, 1)` entries along dim 1: the merge undoes the split, so the merged
state is TE's layout again, and GEMM g's columns must land in te-core's slots of GEMM g."""
from __future__ import annotations

import contextlib
import io
import pickle
import sys
import types
import warnings

import pytest
import torch

import te_core as te
from te_core.compat.te_checkpoint import read_te_extra_state
from te_core.recipe import DelayedScaling, Format

from .test_megatron_grouped_extra_state import _definitions, _megatron_file, megatron  # noqa: F401  (fixture)
from .test_te_checkpoints import TE_RECIPE, _fake_te_recipe_module, _te_extra_state

NUM_GEMMS, IN, OUT, HISTORY, MARGIN = 3, 32, 48, 4, 1
SPLITS = [24, 8, 16]
RECIPE = DelayedScaling(margin=MARGIN, fp8_format=Format.HYBRID, amax_history_len=HISTORY)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@contextlib.contextmanager
def _real_te_recipe(fake: types.ModuleType):
    """TE's recipe module in place of the stand-in's while TE writes its checkpoint."""
    stand_in = sys.modules.get(TE_RECIPE)
    sys.modules[TE_RECIPE] = fake
    try:
        yield
    finally:
        sys.modules[TE_RECIPE] = stand_in


def _te_module_state(fake, gen) -> dict:
    """TE's get_extra_state of a trained GroupedLinear: its recipe object, GEMM-major columns."""
    return {"recipe": fake.DelayedScaling(margin=MARGIN, fp8_format=fake.Format.HYBRID, amax_history_len=HISTORY),
            "scale_fwd": torch.rand(3 * NUM_GEMMS, generator=gen) + 0.5,
            "amax_history_fwd": torch.rand(HISTORY, 3 * NUM_GEMMS, generator=gen) + 0.1,
            "scale_bwd": torch.rand(2 * NUM_GEMMS, generator=gen) + 0.5,
            "amax_history_bwd": torch.rand(HISTORY, 2 * NUM_GEMMS, generator=gen) + 0.1,
            "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": NUM_GEMMS}}


# ---------------------------------------------------------------- the per-expert entries and their merge
def _megatron_split(fake):
    """Megatron-LM's _split_extra_state, compiled from its source, on a TE GroupedLinear (`te` is TE's
    recipe module here, so that its isinstance check takes TE's recipe)."""
    methods = _definitions(_megatron_file("megatron/core/extensions/transformer_engine.py"),
                           ["_encode_extra_state", "_decode_extra_state", "_split_extra_state"])
    namespace = {"torch": torch, "io": io, "pickle": pickle, "is_te_min_version": lambda version: True,
                 "te": types.SimpleNamespace(common=types.SimpleNamespace(recipe=fake))}
    for code in methods.values():
        exec(compile(code, "megatron/core/extensions/transformer_engine.py", "exec"), namespace)
    writer = type("TEGroupedLinear", (), {name: namespace[name] for name in methods})()
    writer.num_gemms, writer.fp8, writer.fp8_calibration = NUM_GEMMS, True, False

    def split(state):
        writer.fp8_meta = {"recipe": state["recipe"], "fp8_checkpoint": True}
        return writer._split_extra_state(_te_extra_state(state))

    return split


def _documented_split(state):
    extra = dict(state["extra_fp8_variables"], num_gemms=1)
    return [_te_extra_state({"extra_fp8_variables": extra, "recipe": state["recipe"],
                             "scale_fwd": state["scale_fwd"].view(3, -1)[:, g],
                             "amax_history_fwd": state["amax_history_fwd"].view(HISTORY, 3, -1)[:, :, g],
                             "scale_bwd": state["scale_bwd"].view(2, -1)[:, g],
                             "amax_history_bwd": state["amax_history_bwd"].view(HISTORY, 2, -1)[:, :, g]})
            for g in range(NUM_GEMMS)]


_MEGATRON_SAFE = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
                  ("collections", "OrderedDict"), (TE_RECIPE, "DelayedScaling"), (TE_RECIPE, "Format"),
                  (TE_RECIPE, "_FormatHelper")}


class _SafeUnpickler(pickle.Unpickler):
    """What Megatron-LM's SafeUnpickler lets through of TE's delayed-scaling state."""

    def find_class(self, module, name):
        if (module, name) not in _MEGATRON_SAFE:
            raise pickle.UnpicklingError(f"refusing {module}.{name}")
        return super().find_class(module, name)


def _documented_merge(module, entries):
    """merge_extra_states' steps: the recipe goes through fp8_meta["recipe"] into the merged pickle."""
    keys = [f"_extra_state{'' if g == 0 else g}" for g in range(module.num_gemms)]
    states = [_SafeUnpickler(io.BytesIO(entries.pop(key).numpy().tobytes())).load() for key in keys]
    module.fp8_meta["recipe"] = states[0]["recipe"]
    merged = {"extra_fp8_variables": dict(states[0]["extra_fp8_variables"], num_gemms=module.num_gemms),
              "recipe": module.fp8_meta["recipe"]}
    for suffix in ("fwd", "bwd"):
        merged[f"scale_{suffix}"] = torch.cat([s[f"scale_{suffix}"].view(-1, 1) for s in states], dim=1).view(-1)
        merged[f"amax_history_{suffix}"] = torch.cat([s[f"amax_history_{suffix}"].view(-1, 1) for s in states],
                                                     dim=1).view(HISTORY, -1)
    entries["_extra_state"] = torch.frombuffer(bytearray(pickle.dumps(merged)), dtype=torch.uint8)
    return entries


@pytest.fixture
def documented(stand_in):
    return te.GroupedLinear, _documented_merge


# ---------------------------------------------------------------- the FP8 result, in float64
def _fp8(t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return (t.float() * scale).to(dtype).double() / scale.double()


def _expected(module, state, x, dy):
    """y and dx of each expert from TE's GEMM g columns: its input, weight and grad output scales."""
    ys, dxs = [], []
    for g, (xg, dyg) in enumerate(zip(x.split(SPLITS), dy.split(SPLITS))):
        s_in, s_w, s_dy = state["scale_fwd"][3 * g], state["scale_fwd"][3 * g + 1], state["scale_bwd"][2 * g]
        w = _fp8(getattr(module, f"weight{g}").detach(), s_w, E4M3)
        ys.append(_fp8(xg, s_in, E4M3) @ w.T + getattr(module, f"bias{g}").detach().double())
        dxs.append(_fp8(dyg, s_dy, E5M2) @ w)
    return torch.cat(ys), torch.cat(dxs)


def _run(module, x, dy):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=RECIPE):
        y = module(x, SPLITS)
    y.backward(dy)
    return y.detach().double(), x.grad.double()


@pytest.mark.parametrize("flavour", ["megatron", "documented"])
def test_te_written_entries_merge_into_each_gemms_slots(flavour, request):
    cls, merge = request.getfixturevalue(flavour)
    gen = torch.Generator().manual_seed(17)
    fake = _fake_te_recipe_module()
    with _real_te_recipe(fake):
        state = _te_module_state(fake, gen)
        entries = (_megatron_split(fake) if flavour == "megatron" else _documented_split)(state)
    assert b"transformer_engine.common.recipe" in entries[0].numpy().tobytes()  # (TE's names, as TE wrote them)
    target = cls(NUM_GEMMS, IN, OUT)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    sd = {k: v for k, v in target.state_dict().items() if k != "_extra_state"}
    sd.update({f"_extra_state{'' if g == 0 else g}": entry for g, entry in enumerate(entries)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read, not restarted with a warning
        target.load_state_dict(merge(target, sd), strict=True)

    got = target.quantization_state()
    for g in range(NUM_GEMMS):
        for direction, slot, suffix, column in (("forward", "input", "fwd", 3 * g),
                                                ("forward", "weight", "fwd", 3 * g + 1),
                                                ("backward", "grad_output", "bwd", 2 * g)):
            entry = got[direction][f"gemm{g}_{slot}"]
            assert torch.equal(entry["scale"], state[f"scale_{suffix}"][column:column + 1]), (g, slot)
            assert torch.equal(entry["amax_history"], state[f"amax_history_{suffix}"][:, column]), (g, slot)
    recipe = target.fp8_meta["recipe"]
    assert (recipe.margin, recipe.fp8_format, recipe.amax_history_len) == (MARGIN, Format.HYBRID, HISTORY)

    x, dy = torch.randn(sum(SPLITS), IN, generator=gen), torch.randn(sum(SPLITS), OUT, generator=gen)
    (y, dx), (y_ref, dx_ref) = _run(target, x, dy), _expected(target, state, x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1.3e-6, atol=1e-5)


def test_te_core_recipe_names_are_read_as_inert_records(monkeypatch):
    """te_core.recipe's names are on the reader's allow-list as records: nothing they name is called."""
    import te_core.recipe

    calls = []

    def hook(*args):
        calls.append(args)

    hook.__module__, hook.__qualname__ = "te_core.recipe", "checkpoint_hook"
    monkeypatch.setattr(te_core.recipe, "checkpoint_hook", hook, raising=False)

    class _Call:
        def __reduce__(self):
            return hook, ("from the checkpoint",)

    state = read_te_extra_state(pickle.dumps({"recipe": DelayedScaling(margin=2), "call": _Call()}))
    assert calls == []
    assert state["call"].args == ("from the checkpoint",) and state["recipe"].te_name == "DelayedScaling"
    assert state["recipe"].fields["margin"] == 2
    with pytest.raises(pickle.UnpicklingError, match=r"te_core\.modules\.linear\.Linear is not on the allow-list"):
        read_te_extra_state(pickle.dumps({"recipe": te.Linear}))
