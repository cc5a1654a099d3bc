"""Transformer Engine's ops.Sequential as a container, through the stand-in: the keys under which
its edits (the constructor, append, extend, insert, del, pop, slicing, +, +=, item assignment)
leave the modules, so the state dict's keys, are TE's, which never renumber the modules that stay,
where torch.nn.Sequential's do; and its call still hands each operation its extra inputs in order
after such edits. The expected keys follow TE's transformer_engine/pytorch/ops/sequential.py."""
from __future__ import annotations

import pytest
import torch

FP32 = dict(rtol=1.3e-6, atol=1e-5)
GROUPS, HIDDEN, FFN = 3, 12, 10
SPLITS = [4, 0, 5]  # one expert without tokens


def _keys(seq):
    """The state dict's keys but the operations' `_extra_state` (each sits under its operation's key)."""
    return [k for k in seq.state_dict() if not k.endswith("._extra_state")]


def test_edits_keep_transformer_engines_keys(stand_in):
    """TE's rules, one assertion group each:
    - append / extend / the constructor (TE's `_next_key`): a module added at the end takes the key
      one past the largest key that int() reads, non-integer keys ignored, "0" where there is none;
    - `del seq[i]` / `del seq[a:b]` (TE's `__delitem__`): the modules' keys are deleted, the others stay;
    - `insert(i, m)`: the keys from position i on (TE's `_get_keys_by_idx(slice(i, None))`) and one
      new key; each module moves one key along, m takes position i's key; past the end, an append;
    - `pop(i)`: `seq[i]` then `del seq[i]`; with a slice, a new Sequential;
    - `seq[a:b]` and `seq + other` (TE's `__getitem__` and `__add__`): a new Sequential extended with
      the modules, so keyed from "0";
    - `seq[i] = m` (TE's `__setitem__`): m under position i's key;
    - a dict (TE's constructor: add_module per item): its keys."""
    from transformer_engine.pytorch import ops

    def linear():
        return ops.BasicLinear(4, 4)

    def bias():
        return ops.Bias(4)

    seq = ops.Sequential(linear(), bias(), torch.nn.Tanh(), linear())
    assert list(seq.state_dict()) == ["0.weight", "0._extra_state", "1.bias", "1._extra_state", "3.weight",
                                      "3._extra_state"]
    del seq[1]
    assert _keys(seq) == ["0.weight", "3.weight"]  # (torch.nn.Sequential: 0, 2)
    seq.append(bias())
    assert _keys(seq) == ["0.weight", "3.weight", "4.bias"]
    inserted = bias()
    seq.insert(1, inserted)  # keys 2 (Tanh's), 3, 4 and a new 5
    assert _keys(seq) == ["0.weight", "2.bias", "4.weight", "5.bias"] and seq[1] is inserted
    assert [k for k, _ in seq.named_children()] == ["0", "2", "3", "4", "5"] and isinstance(seq[2], torch.nn.Tanh)
    first = seq[0]
    assert seq.pop(0) is first and _keys(seq) == ["2.bias", "4.weight", "5.bias"]
    part = seq[1:3]
    assert type(part) is ops.Sequential and _keys(part) == ["1.weight"] and [*part] == [seq[1], seq[2]]
    popped = seq.pop(slice(0, 2))
    assert _keys(popped) == ["0.bias"] and _keys(seq) == ["4.weight", "5.bias"]
    seq.insert(-1, linear())
    assert _keys(seq) == ["4.weight", "5.weight", "6.bias"]
    seq.insert(10, linear())
    assert _keys(seq) == ["4.weight", "5.weight", "6.bias", "7.weight"]
    seq[-1] = bias()
    assert _keys(seq) == ["4.weight", "5.weight", "6.bias", "7.bias"]
    del seq[-2:]
    seq.extend([bias()])
    assert _keys(seq) == ["4.weight", "5.weight", "6.bias"]

    named = ops.Sequential({"norm": bias(), "fc": linear()})
    named.append(bias())
    assert _keys(named) == ["norm.bias", "fc.weight", "0.bias"]
    named.insert(0, linear())
    assert _keys(named) == ["norm.weight", "fc.bias", "0.weight", "1.bias"]
    assert _keys(named[0:2]) == ["0.weight", "1.bias"]
    assert _keys(named + ops.Sequential(bias())) == ["0.weight", "1.bias", "2.weight", "3.bias", "4.bias"]
    named += [linear()]
    assert _keys(named) == ["norm.weight", "fc.bias", "0.weight", "1.bias", "2.weight"]
    numbered = ops.Sequential({"7": bias(), "x": linear()}).append(bias())
    assert _keys(numbered) == ["7.bias", "x.weight", "8.bias"]
    empty = ops.Sequential()
    empty.insert(0, bias()).insert(0, linear())
    assert _keys(empty) == ["0.weight", "1.bias"]


def test_call_after_edits_hands_extra_inputs_in_order(stand_in):
    """Sequential(GroupedLinear, SwiGLU, GroupedLinear) whose SwiGLU is deleted and a ScaledSwiGLU
    inserted in its place (keys 0, 2, 3, as TE's): seq(x, splits, probs, splits) against float64,
    output and the gradients of x, probs and every weight; a fresh Sequential with those keys loads
    its state dict strictly."""
    from transformer_engine.pytorch import ops

    torch.manual_seed(5)
    gate_up, down = ops.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, bias=False), ops.GroupedLinear(GROUPS, FFN, HIDDEN,
                                                                                            bias=False)
    seq = ops.Sequential(gate_up, ops.SwiGLU(), down)
    del seq[1]
    seq.insert(1, ops.ScaledSwiGLU())
    assert [k for k, _ in seq.named_children()] == ["0", "2", "3"] and [*seq][::2] == [gate_up, down]
    tokens = sum(SPLITS)
    x, probs = torch.randn(tokens, HIDDEN, requires_grad=True), torch.rand(tokens, requires_grad=True)
    splits = torch.tensor(SPLITS, dtype=torch.int32)
    y = seq(x, splits, probs, splits)
    w1 = [getattr(gate_up, f"weight{g}").detach().double().requires_grad_() for g in range(GROUPS)]
    w2 = [getattr(down, f"weight{g}").detach().double().requires_grad_() for g in range(GROUPS)]
    x64, p64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    a, b = torch.cat([r @ w1[g].T for g, r in enumerate(x64.split(SPLITS))]).chunk(2, dim=-1)
    h = a * torch.sigmoid(a) * b * p64.unsqueeze(-1)
    want = torch.cat([r @ w2[g].T for g, r in enumerate(h.split(SPLITS))])
    torch.testing.assert_close(y.double(), want, **FP32)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy.double())
    got = [x, probs] + [getattr(m, f"weight{g}") for m in (gate_up, down) for g in range(GROUPS)]
    for tensor, leaf in zip(got, [x64, p64] + w1 + w2, strict=True):
        torch.testing.assert_close(tensor.grad.double(), leaf.grad, **FP32)
    fresh = ops.Sequential({"0": ops.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, bias=False), "2": ops.ScaledSwiGLU(),
                            "3": ops.GroupedLinear(GROUPS, FFN, HIDDEN, bias=False)})
    fresh.load_state_dict(seq.state_dict())
    assert torch.equal(fresh(x, splits, probs, splits), y)


def test_bad_container_arguments_say_what_is_wrong(stand_in):
    from transformer_engine.pytorch import ops

    seq = ops.Sequential(ops.Bias(4), torch.nn.Tanh())
    with pytest.raises(IndexError, match=r"ops.Sequential: index 2 is out of range for its 2 module\(s\)"):
        seq[2]
    with pytest.raises(IndexError, match=r"ops.Sequential: index -3 is out of range"):
        del seq[-3]
    with pytest.raises(TypeError, match="ops.Sequential: index must be an int or a slice, got str"):
        seq["0"]
    with pytest.raises(TypeError, match="ops.Sequential: index must be an int or a slice, got float"):
        seq.insert(1.0, torch.nn.Tanh())
    with pytest.raises(TypeError, match="ops.Sequential: append takes a torch.nn.Module, got function"):
        seq.append(lambda t: t.tanh())
    with pytest.raises(TypeError, match="ops.Sequential: insert takes a torch.nn.Module, got NoneType"):
        seq.insert(0, None)
    with pytest.raises(TypeError, match=r"ops.Sequential: seq\[idx\] = module takes a torch.nn.Module, got int"):
        seq[0] = 3
    with pytest.raises(TypeError, match="ops.Sequential: assign one module at an int index, not a slice"):
        seq[0:1] = torch.nn.Tanh()
    with pytest.raises(TypeError, match="ops.Sequential: the module at key 'norm' takes a torch.nn.Module, got str"):
        ops.Sequential({"norm": "rmsnorm"})
    assert _keys(seq) == ["0.bias"] and len(seq) == 2  # (nothing changed)
