"""torch.compile(fullgraph=True) of packed sequences (qkv_format="thd"): the offsets are never
read on the host inside a graph. The layer with rotary embeddings, every recipe, equals eager
over steps whose offsets change (no recompilation: the values are the graph's inputs), and what
eager checks on the host the graph checks on the device: bad offsets, a max_seqlen shorter than
a sequence, rotary positions past the table, each raising its own message."""

import copy

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core import recipe

RECIPES = {
    "bf16": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
HIDDEN, FFN, HEADS, TOKENS, MAX_SEQLEN = 64, 128, 4, 64, 48
OFFSETS = ([0, 16, 48, 64], [0, 40, 40, 64])  # the second step's: another split, an empty sequence


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer():
    torch.manual_seed(0)
    return tm.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               attn_input_format="thd", self_attn_mask_type="padding_causal")


def _step_fn(rec):
    rope = te.RotaryPositionEmbedding(HIDDEN // HEADS)(MAX_SEQLEN)

    def step(model, x, cu, max_seqlen=MAX_SEQLEN):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return model(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                         rotary_pos_emb=rope)

    return step


def _run(step, model, x, cu):
    x = x.clone().requires_grad_(True)
    y = step(model, x, cu)
    y.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_layer_compiles_fullgraph_and_matches_eager(name):
    rec = RECIPES[name]() if RECIPES[name] else None
    eager_model = _layer()
    compiled_model = copy.deepcopy(eager_model)
    if rec is not None:  # both start from scale 1, as a graph does (test_first_scale)
        te.init_quantization_state(eager_model, rec)
        te.init_quantization_state(compiled_model, rec)
    step = _step_fn(rec)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i, offsets in enumerate(OFFSETS):
        x = torch.randn(TOKENS, HIDDEN)
        cu = torch.tensor(offsets, dtype=torch.int32)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run(compiled, compiled_model, x, cu)
        want = _run(step, eager_model, x, cu)
        for j, (g, w) in enumerate(zip(got, want)):
            if te.get_backend().name == "reference":
                assert torch.equal(g, w), f"step {i}, tensor {j}: {(g - w).abs().max()}"
            else:  # an accelerator's traced twins round differently (see test_compile_fp8)
                error = (g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)
                assert error <= 1e-2, f"step {i}, tensor {j}: relative error {error:.3g}"


def _compiled_attention(**kwargs):
    dpa = tm.DotProductAttention(HEADS, HIDDEN // HEADS, qkv_format="thd", attn_mask_type="padding_causal")

    def attend(q, k, v, cu):
        return dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kwargs)

    return torch.compile(attend, backend="aot_eager", fullgraph=True)


def _qkv():
    return [torch.randn(TOKENS, HEADS, HIDDEN // HEADS) for _ in range(3)]


@pytest.mark.reference_only  # on an accelerator a failed device check is a device-side assertion
@pytest.mark.parametrize("offsets, max_seqlen, message", [
    ([0, 16, 8, 64], 64, "cu_seqlens_q must start at 0, never decrease and end at the number of packed tokens"),
    ([0, 16, 48, 60], 64, r"end at the number of packed tokens \(64\)"),
    ([0, 8, 48, 64], 32, "the max_seqlen for cu_seqlens_q is 32, shorter than one of its sequences"),
])
def test_compiled_packed_offsets_are_checked_on_the_device(offsets, max_seqlen, message):
    attend = _compiled_attention(max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    attend(*_qkv(), torch.tensor([0, 16, 32, 64], dtype=torch.int32))  # valid offsets run
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(RuntimeError, match=message):
        attend(*_qkv(), torch.tensor(offsets, dtype=torch.int32))


@pytest.mark.reference_only
def test_compiled_packed_attention_needs_max_seqlen():
    with pytest.raises(Exception, match="pass max_seqlen_q .* under torch.compile or graph capture"):
        _compiled_attention()(*_qkv(), torch.tensor([0, 16, 48, 64], dtype=torch.int32))


@pytest.mark.reference_only
def test_compiled_packed_rotary_positions_are_checked_on_the_device():
    from te_core.modules.rope import apply_rotary_pos_emb

    freqs = te.RotaryPositionEmbedding(16)(32)
    rotate = torch.compile(lambda t, cu, starts: apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu,
                                                                      start_positions=starts),
                           backend="aot_eager", fullgraph=True)
    t, cu = torch.randn(40, 2, 16), torch.tensor([0, 8, 40], dtype=torch.int32)
    eager = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu, start_positions=torch.tensor([0, 0]))
    assert torch.equal(rotate(t, cu, torch.tensor([0, 0])), eager)
    with pytest.raises(RuntimeError, match="start_positions must not be negative"):
        rotate(t, cu, torch.tensor([0, -1]))
    with pytest.raises(RuntimeError, match=r"reach past their rotary positions, but freqs hold positions 0\.\.31"):
        rotate(t, cu, torch.tensor([0, 1]))  # the 32-token sequence from position 1 needs position 32


@pytest.mark.reference_only
def test_compiled_padding_between_packed_sequences_says_why():
    dpa = tm.DotProductAttention(HEADS, HIDDEN // HEADS, qkv_format="thd", attn_mask_type="padding_causal")
    cu, padded = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 16, 64], dtype=torch.int32)
    attend = torch.compile(lambda q, k, v: dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                                               cu_seqlens_kv_padded=padded, max_seqlen_q=32, max_seqlen_kv=32),
                           backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"padding between packed sequences \(cu_seqlens_q_padded\) cannot run under "
                                        r"torch.compile or graph capture"):
        attend(*_qkv())


@pytest.mark.reference_only  # it replaces torch.Tensor's host reads for the whole process
@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_layer_reads_nothing_on_the_host_inside_a_capture(monkeypatch, name):
    """Inside a graph capture (here: host_readable answering False, as a capturing stream makes
    it) a packed layer's forward and backward read no tensor value on the host, every recipe,
    and give the eager step's results: a capture could hold the step as it is."""
    import te_core.modules._packed as packed_module
    import te_core.ops.packed_sequences as packed_sequences

    rec = RECIPES[name]() if RECIPES[name] else None
    model, step = _layer(), _step_fn(rec)
    x, cu = torch.randn(TOKENS, HIDDEN), torch.tensor(OFFSETS[0], dtype=torch.int32)
    want = [_run(step, model, x, cu) for _ in range(2)]  # the second step: with the state the first made

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    model = _layer()
    _run(step, model, x, cu)
    with monkeypatch.context() as patched:
        for where in (packed_sequences, packed_module):
            patched.setattr(where, "host_readable", lambda t: False)
        for method in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
            patched.setattr(torch.Tensor, method, host_read)
        got = _run(step, model, x, cu)
    assert all(torch.equal(g, w) for g, w in zip(got, want[1]))


@pytest.mark.reference_only
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_compiled_rotary_start_positions_are_read_on_the_device(fmt):
    """apply_rotary_pos_emb with start_positions (a KV-cache step's) under torch.compile: each
    sequence from its own start, as eagerly, one graph for any starts; a start past freqs'
    positions raises its message from the device."""
    from te_core.modules.rope import apply_rotary_pos_emb

    freqs = te.RotaryPositionEmbedding(16)(12)
    rotate = torch.compile(lambda t, starts: apply_rotary_pos_emb(t, freqs, fmt, start_positions=starts),
                           backend="aot_eager", fullgraph=True)
    t = torch.randn(3, 4, 2, 16) if fmt == "bshd" else torch.randn(4, 3, 2, 16)  # 3 sequences of 4 tokens
    for i, starts in enumerate(([0, 5, 8], [8, 0, 2])):
        starts = torch.tensor(starts)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            assert torch.equal(rotate(t, starts), apply_rotary_pos_emb(t, freqs, fmt, start_positions=starts))
    with pytest.raises(RuntimeError, match=r"a start plus the 4 tokens must stay within freqs' positions 0\.\.11"):
        rotate(t, torch.tensor([0, 9, 0]))
