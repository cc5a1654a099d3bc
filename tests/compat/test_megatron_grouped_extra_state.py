"""GroupedLinear's extra state through Megatron-LM's TEGroupedLinear distributed checkpoint: its
_split_extra_state unpickles the uint8 tensor with its SafeUnpickler, slices each expert's FP8
scales and amax histories out of TE's module layout (`scale_fwd.view(3, -1)[:, gemm]`, ...) and
re-pickles them; on load its merge_extra_states pre-hook unpickles the entries, assigns
fp8_meta["recipe"], concatenates the columns and pickles the merged state for set_extra_state.

Two flavours of those steps: Megatron-LM's own functions, compiled from its source at test time
(MEGATRON_GIT_DIR, a git directory of Megatron-LM; skipped without one: nothing of Megatron is
kept in this repository), with the stand-in `transformer_engine` as their `te`; and the same
byte-level steps as Megatron-LM documents them, written here, which run everywhere."""
from __future__ import annotations

import ast
import io
import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import te_core as te
from te_core.quantization.state import extra_state
from te_core.recipe import DelayedScaling, Format

MEGATRON_GIT_DIR = os.environ.get("MEGATRON_GIT_DIR")
NUM_GEMMS, IN, OUT, HISTORY = 3, 32, 48, 4
SPLITS = [24, 0, 40]  # the second expert gets no tokens: its slots stay fresh (never cast)
RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=HISTORY)


# ---------------------------------------------------------------- Megatron-LM's functions, from its source
def _megatron_file(path: str) -> str:
    if not MEGATRON_GIT_DIR:
        pytest.skip("set MEGATRON_GIT_DIR to a git directory of Megatron-LM to run its split and merge")
    try:
        return subprocess.run(["git", f"--git-dir={MEGATRON_GIT_DIR}", "show", f"HEAD:{path}"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no Megatron-LM git directory at {MEGATRON_GIT_DIR} (set MEGATRON_GIT_DIR)")


def _definitions(source: str, names) -> dict:
    """{name: dedented source} of the functions and classes `names`, wherever they are nested."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names and node.name not in found:
            found[node.name] = textwrap.dedent(ast.get_source_segment(source, node))
    missing = set(names) - set(found)
    if missing:
        pytest.skip(f"Megatron-LM's source has no {', '.join(sorted(missing))} (moved or renamed)")
    return found


def _te_version_at_least(version: str) -> bool:
    import transformer_engine
    from packaging.version import Version

    return Version(transformer_engine.__version__) >= Version(version)


@pytest.fixture
def megatron(stand_in, monkeypatch):
    """The TEGroupedLinear methods (merge_extra_states, _encode_extra_state, _decode_extra_state,
    _split_extra_state) compiled onto a GroupedLinear subclass, SafeUnpickler as
    megatron.core.safe_globals, CUDA synchronization a no-op on this CPU machine."""
    import transformer_engine

    safe = _definitions(_megatron_file("megatron/core/safe_globals.py"), ["SafeUnpickler"])
    safe_globals = types.ModuleType("megatron.core.safe_globals")
    exec(compile(safe["SafeUnpickler"], "megatron/core/safe_globals.py", "exec"), {"pickle": pickle},
         safe_globals.__dict__)
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.safe_globals", safe_globals)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    methods = ["merge_extra_states", "_encode_extra_state", "_decode_extra_state", "_split_extra_state"]
    namespace = {"torch": torch, "io": io, "pickle": pickle, "te": transformer_engine,
                 "is_te_min_version": _te_version_at_least}
    for name, code in _definitions(_megatron_file("megatron/core/extensions/transformer_engine.py"),
                                   methods).items():
        exec(compile(code, "megatron/core/extensions/transformer_engine.py", "exec"), namespace)

    class MegatronGroupedLinear(te.GroupedLinear):
        _encode_extra_state = namespace["_encode_extra_state"]
        _decode_extra_state = namespace["_decode_extra_state"]
        _split_extra_state = namespace["_split_extra_state"]

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._register_load_state_dict_pre_hook(namespace["merge_extra_states"], with_module=True)

    return MegatronGroupedLinear, lambda module, entries: entries  # (the pre-hook merges on load)


# ---------------------------------------------------------------- the same steps, as Megatron-LM documents them
_SAFE = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
         ("collections", "OrderedDict"), ("transformer_engine.common.recipe", "DelayedScaling")}


class _SafeUnpickler(pickle.Unpickler):
    """What Megatron-LM's SafeUnpickler lets through of a delayed-scaling state: tensors and TE's
    recipe; te-core's own names (te_core.recipe) are refused, as there."""

    def find_class(self, module, name):
        if (module, name) not in _SAFE:
            raise pickle.UnpicklingError(f"refusing {module}.{name}")
        return super().find_class(module, name)


def _unpickle(tensor: torch.Tensor):
    return _SafeUnpickler(io.BytesIO(tensor.numpy().tobytes())).load()


def _pickled(state: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _documented_split(module, tensor):
    """Each GEMM's columns (role-major: every input, then every weight, then every output)."""
    state = _unpickle(tensor)
    extra = dict(state["extra_fp8_variables"], num_gemms=1)
    length = module.fp8_meta["recipe"].amax_history_len
    return [_pickled({"extra_fp8_variables": extra, "recipe": state["recipe"],
                      "scale_fwd": state["scale_fwd"].view(3, -1)[:, g],
                      "amax_history_fwd": state["amax_history_fwd"].view(length, 3, -1)[:, :, g],
                      "scale_bwd": state["scale_bwd"].view(2, -1)[:, g],
                      "amax_history_bwd": state["amax_history_bwd"].view(length, 2, -1)[:, :, g]})
            for g in range(module.num_gemms)]


def _documented_merge(module, entries):
    keys = [f"_extra_state{'' if g == 0 else g}" for g in range(module.num_gemms)]
    states = [_unpickle(entries.pop(key)) for key in keys]
    module.fp8_meta["recipe"] = states[0]["recipe"]
    recipe = module.fp8_meta["recipe"]
    assert isinstance(recipe, DelayedScaling)
    merged = {"extra_fp8_variables": dict(states[0]["extra_fp8_variables"], num_gemms=module.num_gemms),
              "recipe": recipe}
    for suffix in ("fwd", "bwd"):
        merged[f"scale_{suffix}"] = torch.stack([s[f"scale_{suffix}"] for s in states], dim=1).reshape(-1)
        merged[f"amax_history_{suffix}"] = torch.stack(
            [s[f"amax_history_{suffix}"] for s in states], dim=2).reshape(recipe.amax_history_len, -1)
    entries["_extra_state"] = _pickled(merged)
    return entries


@pytest.fixture
def documented(stand_in):
    return te.GroupedLinear, _documented_merge


# ---------------------------------------------------------------- the round trip
def _trained(cls, gen):
    module = cls(NUM_GEMMS, IN, OUT)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    for step in range(3):
        x = torch.randn(sum(SPLITS), IN, generator=gen, requires_grad=True) * (1 + step)
        with te.autocast(recipe=RECIPE):
            y = module(x, SPLITS)
        y.backward(torch.randn(y.shape, generator=gen))
    return module


def _dist_checkpoint(module, split):
    """The per-expert entries Megatron-LM's _sharded_state_dict_grouped saves, by their keys."""
    full = module.state_dict(keep_vars=True)
    entries = {k: v.detach().clone() for k, v in full.items() if k != "_extra_state"}
    for g, state in enumerate(split(module, full["_extra_state"])):
        entries[f"_extra_state{'' if g == 0 else g}"] = state.clone()
    return entries


def _forward(module, x, dy):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=RECIPE):
        y = module(x, [16, 8, 24])
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("flavour", ["megatron", "documented"])
def test_split_and_merged_extra_state_loads_back_exactly(flavour, request):
    cls, merge = request.getfixturevalue(flavour)
    split = cls._split_extra_state if flavour == "megatron" else _documented_split
    gen = torch.Generator().manual_seed(11)
    source = _trained(cls, gen)
    entries = _dist_checkpoint(source, split)
    target = cls(NUM_GEMMS, IN, OUT)
    target.load_state_dict(merge(target, entries), strict=True)

    for direction, slots in source.quantization_state().items():
        assert slots, direction
        for name, entry in slots.items():
            for key, value in entry.items():
                assert torch.equal(target.quantization_state()[direction][name][key], value), (name, key)
    assert target._recipe_state.fresh_slots() == source._recipe_state.fresh_slots()
    assert source._recipe_state.fresh_slots()["forward"]["gemm1_input"] is True  # (the expert without tokens)
    assert target.fp8_meta["recipe"].amax_history_len == HISTORY

    x, dy = torch.randn(48, IN, generator=gen), torch.randn(48, OUT, generator=gen)
    (y, dx), (y_ref, dx_ref) = _forward(target, x, dy), _forward(source, x, dy)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    # (the scales decide the result: the same weights without the loaded state compute another one)
    stateless = cls(NUM_GEMMS, IN, OUT)
    stateless.load_state_dict({k: v for k, v in source.state_dict().items() if "_extra_state" not in k}, strict=False)
    assert not torch.equal(_forward(stateless, x, dy)[0], y_ref)


def test_each_experts_entry_holds_its_own_scales(documented):
    """The columns go role by role, so Megatron-LM's slice of GEMM g is expert g's state (and a
    checkpoint resharded over other expert-parallel ranks gives each expert its own)."""
    source = _trained(te.GroupedLinear, torch.Generator().manual_seed(3))
    live = source.quantization_state()
    for g, entry in enumerate(_documented_split(source, source.get_extra_state())):
        state = _unpickle(entry)
        for column, (direction, role) in enumerate([("forward", "input"), ("forward", "weight")]):
            assert torch.equal(state["scale_fwd"][column:column + 1], live[direction][f"gemm{g}_{role}"]["scale"])
            assert torch.equal(state["amax_history_fwd"][:, column], live[direction][f"gemm{g}_{role}"]["amax_history"])
        assert torch.equal(state["scale_bwd"][:1], live["backward"][f"gemm{g}_grad_output"]["scale"])
        assert torch.equal(state["scale_fwd"][2], torch.tensor(1.0))  # TE's output column: kept at its initial value


def test_earlier_torch_save_form_still_loads():
    source = _trained(te.GroupedLinear, torch.Generator().manual_seed(5))
    buffer = io.BytesIO()
    torch.save({"te_core_extra_state": 1, **extra_state(source._recipe_state)}, buffer)
    sd = dict(source.state_dict(), _extra_state=torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
    target = te.GroupedLinear(NUM_GEMMS, IN, OUT)
    target.load_state_dict(sd)
    for direction, slots in source.quantization_state().items():
        for name, entry in slots.items():
            assert torch.equal(target.quantization_state()[direction][name]["scale"], entry["scale"])
            assert torch.equal(target.quantization_state()[direction][name]["amax_history"], entry["amax_history"])
    assert target._recipe_state.fresh_slots() == source._recipe_state.fresh_slots()


class _Call:
    def __reduce__(self):
        return (print, ("not to be printed",))


def test_loading_refuses_globals_off_the_allow_list(capsys):
    payload = {"extra_fp8_variables": {"te_core_extra_state": 2, "num_gemms": 1}, "recipe": _Call()}
    with pytest.raises(ValueError, match="builtins.print is not on the allow-list of te-core extra state"):
        te.Linear(16, 16).set_extra_state(_pickled(payload))
    assert "not to be printed" not in capsys.readouterr().out


def test_fp8_meta_recipe_write_reads_back_until_a_load():
    module = _trained(te.GroupedLinear, torch.Generator().manual_seed(7))
    saved = module.get_extra_state()
    module.fp8_meta["recipe"] = DelayedScaling(amax_history_len=9).to_config()
    assert module.fp8_meta["recipe"].amax_history_len == 9
    module.set_extra_state(saved)
    assert module.fp8_meta["recipe"].amax_history_len == HISTORY
    with pytest.raises(TypeError, match=r"fp8_meta\['recipe'\] takes a recipe .* got int"):
        module.fp8_meta["recipe"] = 3
    assert module.fp8_meta["recipe"].amax_history_len == HISTORY and list(module.fp8_meta) == [
        "recipe", "fp8_checkpoint", "fp8_group"]
