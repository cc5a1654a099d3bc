"""te.InferenceParams: generation with a KV cache. A prompt's prefill and then one token per
step, through MultiheadAttention / TransformerLayer with rotary embeddings, give exactly the
outputs the module gives each whole sequence without a cache (causal), in bshd, sbhd and thd;
sequences finish and new ones take their place."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import te_core as te
import te_core.modules as tm

HIDDEN, HEADS, GROUPS, LAYER = 32, 4, 2, 3
TOL = dict(rtol=1.3e-6, atol=1e-5)


def _layer(fmt="bshd"):
    torch.manual_seed(0)
    return tm.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                               attention_dropout=0.0, self_attn_mask_type="causal", layer_number=LAYER,
                               attn_input_format=fmt)


def _params(qkv_format="bshd", max_batch_size=2, paged=False):
    pages = dict(is_paged=True, page_size=4, total_num_pages=max_batch_size * 4) if paged else {}
    return te.InferenceParams(max_batch_size, 16, num_heads_kv=GROUPS, head_dim_k=HIDDEN // HEADS,
                              dtype=torch.float32, qkv_format=qkv_format, max_ctx_len=8, **pages)


def _alone(layer, x, freqs):
    """Each position's output for the whole sequence x (s, hidden), without a cache."""
    return layer(x[None], rotary_pos_emb=freqs)[0]


def _to_format(rows, fmt):
    """Per-sequence (n_i, hidden) rows as the step's input: padded bshd / sbhd, or packed thd."""
    if fmt == "thd":
        return torch.cat(rows)
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    return padded.transpose(0, 1) if fmt == "sbhd" else padded


def _from_format(out, lengths, fmt):
    if fmt == "thd":
        return list(out.split(lengths))
    out = out.transpose(0, 1) if fmt == "sbhd" else out
    return [out[i, :n] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("fmt, paged", [("bshd", False), ("sbhd", False), ("thd", False), ("bshd", True),
                                        ("thd", True)])
def test_prefill_then_decode_equals_the_whole_sequences(fmt, paged):
    layer = _layer()
    layer.eval()
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(16)
    cached = tm.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                                 attention_dropout=0.0, self_attn_mask_type="causal", layer_number=LAYER,
                                 attn_input_format=fmt)
    cached.load_state_dict(layer.state_dict())
    cached.eval()
    torch.manual_seed(1)
    seqs = [torch.randn(9, HIDDEN), torch.randn(7, HIDDEN)]
    want = [_alone(layer, s, freqs) for s in seqs]
    params = _params(fmt, paged=paged)
    prompt = [5, 3]
    steps = [prompt] + [[1, 1]] * 4
    done = [0, 0]
    with torch.no_grad():
        for lengths in steps:
            params.pre_step(OrderedDict(zip(["a", "b"], lengths)))
            rows = [s[d:d + n] for s, d, n in zip(seqs, done, lengths)]
            extra = dict(cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv) if fmt == "thd" else {}
            out = cached(_to_format(rows, fmt), rotary_pos_emb=freqs, inference_params=params, **extra)
            for got, w, d, n in zip(_from_format(out, lengths, fmt), want, done, lengths):
                torch.testing.assert_close(got, w[d:d + n], **TOL)
            if fmt != "thd":  # the padding rows of a shorter sequence's step stay zero after attention's
                assert out.shape[:2] == ((max(lengths), 2) if fmt == "sbhd" else (2, max(lengths)))
            done = [d + n for d, n in zip(done, lengths)]


@pytest.mark.parametrize("paged", [False, True])
def test_finished_sequences_free_their_place(paged):
    """Sequence a finishes after its prompt; c takes its place (its slot, or its pages) while b
    goes on."""
    layer = _layer()
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(16)
    torch.manual_seed(2)
    seqs = {name: torch.randn(n, HIDDEN) for name, n in (("a", 4), ("b", 6), ("c", 6))}
    want = {name: _alone(layer, s, freqs) for name, s in seqs.items()}
    params = _params(paged=paged)
    done = dict.fromkeys(seqs, 0)
    with torch.no_grad():
        for step in (OrderedDict(a=4, b=3), OrderedDict(b=1, c=4), OrderedDict(b=1, c=1), OrderedDict(c=1)):
            params.pre_step(step)
            rows = [seqs[name][done[name]:done[name] + n] for name, n in step.items()]
            out = layer(_to_format(rows, "bshd"), rotary_pos_emb=freqs, inference_params=params)
            for got, (name, n) in zip(_from_format(out, list(step.values()), "bshd"), step.items()):
                torch.testing.assert_close(got, want[name][done[name]:done[name] + n], **TOL)
                done[name] += n


@pytest.mark.parametrize("fmt, paged", [("bshd", False), ("sbhd", False), ("bshd", True)])
def test_a_decoding_row_padded_to_a_prompt_needs_no_longer_rotary_table(fmt, paged):
    """A step where sequence a decodes late in its life while b brings a prompt: a's row is
    padded to the prompt's length, whose padding would sit past max_sequence_length. The rotary
    table made for max_sequence_length positions serves it (padding tokens take their row's last
    position), as Transformer Engine's fused rotary kernel serves it; a sequence that really
    reaches past the table is an error naming it."""
    layer, whole = _layer(fmt), _layer()  # (the same weights: the whole sequences run in bshd)
    layer.eval()
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(16)  # exactly max_sequence_length positions
    torch.manual_seed(3)
    seqs = {"a": torch.randn(14, HIDDEN), "b": torch.randn(6, HIDDEN)}
    want = {name: _alone(whole.eval(), s, freqs) for name, s in seqs.items()}
    params = _params(fmt, paged=paged)
    done = dict.fromkeys(seqs, 0)
    with torch.no_grad():
        for step in (OrderedDict(a=8), OrderedDict(a=4), OrderedDict(a=1, b=5), OrderedDict(a=1, b=1)):
            params.pre_step(step)
            rows = [seqs[name][done[name]:done[name] + n] for name, n in step.items()]
            out = layer(_to_format(rows, fmt), rotary_pos_emb=freqs, inference_params=params)
            for got, (name, n) in zip(_from_format(out, list(step.values()), fmt), step.items()):
                torch.testing.assert_close(got, want[name][done[name]:done[name] + n], **TOL)
                done[name] += n
        params.pre_step(OrderedDict(a=1))  # a holds 15 tokens: position 14 is past a 14-position table
        with pytest.raises(ValueError, match=r"a sequence of this step reaches position 14, but freqs hold "
                                             r"positions 0\.\.13: make the rotary embedding for at least "
                                             r"max_sequence_length=16 positions"):
            layer(_to_format([seqs["a"][:1]], fmt), rotary_pos_emb=freqs[:14], inference_params=params)


def test_multihead_attention_decode_and_the_te_step_api():
    torch.manual_seed(3)
    mha = tm.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, layer_number=1,
                                attn_mask_type="padding_causal", qkv_format="bshd")
    x = torch.randn(1, 6, HIDDEN)
    with torch.no_grad():
        want = mha(x, attn_mask_type="causal")
        params = _params(max_batch_size=1)
        params.pre_step(OrderedDict(s=4))
        got = [mha(x[:, :4], inference_params=params)]
        for i in (4, 5):
            params.pre_step(OrderedDict(s=1))
            got.append(mha(x[:, i:i + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(got, dim=1), want, **TOL)
    assert params.sequences == OrderedDict(s=6) and params.get_seqlens_pre_step().tolist() == [5]
    # Transformer Engine's step(): the step's sequences' whole caches, in bshd
    params.pre_step(OrderedDict(s=1))
    k_new = torch.randn(1, 1, GROUPS, HIDDEN // HEADS)
    k_cache, v_cache, cu_q, cu_kv, max_len, fmt = params.step(1, k_new, k_new.clone(), "bshd")
    assert k_cache.shape == (1, 16, GROUPS, HIDDEN // HEADS) and fmt == "bshd" and max_len == 16
    assert torch.equal(k_cache[0, 6], k_new[0, 0]) and cu_q.tolist() == [0, 1] and cu_kv.tolist() == [0, 7]


def test_bad_uses_say_what_is_wrong():
    with pytest.raises(NotImplementedError, match="custom cache managers"):
        te.InferenceParams(2, 16, 2, 8, torch.float32, custom_cache_manager=object())
    with pytest.raises(ValueError, match="page_size that divides max_sequence_length=16"):
        te.InferenceParams(2, 16, 2, 8, torch.float32, is_paged=True, page_size=5, total_num_pages=8)
    with pytest.raises(ValueError, match=r"total_num_pages = max_batch_size \* max_sequence_length / page_size = 8"):
        te.InferenceParams(2, 16, 2, 8, torch.float32, is_paged=True, page_size=4, total_num_pages=6)
    with pytest.raises(ValueError, match="num_heads_kv, head_dim_k and dtype are required"):
        te.InferenceParams(2, 16)
    with pytest.raises(ValueError, match="needs max_ctx_len"):
        te.InferenceParams(2, 16, 2, 8, torch.float32, qkv_format="thd")
    params = _params()
    with pytest.raises(ValueError, match="1 to max_batch_size=2 sequences"):
        params.pre_step(OrderedDict(a=1, b=1, c=1))
    with pytest.raises(ValueError, match="more than max_sequence_length=16"):
        params.pre_step(OrderedDict(a=17))
    core = te.DotProductAttention(HEADS, HIDDEN // HEADS, num_gqa_groups=GROUPS, qkv_format="bshd")  # no layer_number
    params.pre_step(OrderedDict(a=2))
    q, kv = torch.randn(1, 2, HEADS, HIDDEN // HEADS), torch.randn(1, 2, GROUPS, HIDDEN // HEADS)
    with pytest.raises(ValueError, match="needs layer_number"):
        core(q, kv, kv, inference_params=params)
    with pytest.raises(RuntimeError, match="call pre_step"):
        _params().get_seqlens_pre_step()


def test_attention_blocks_without_layer_number_cache_as_layer_1():
    """MultiheadAttention and TransformerLayer built without layer_number take the cache as
    layer 1, as Transformer Engine's do: decoding step by step equals the causal forward."""
    torch.manual_seed(5)
    for block in (tm.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, qkv_format="bshd", attention_dropout=0.0,
                                        attn_mask_type="causal"),
                  te.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                                      attention_dropout=0.0, attn_input_format="bshd", self_attn_mask_type="causal")):
        assert block.layer_number is None if isinstance(block, te.TransformerLayer) else block.layer_number == 1
        x = torch.randn(1, 5, HIDDEN)
        full = block(x)
        full = full[0] if isinstance(full, tuple) else full
        params = _params()
        steps = []
        for lo, hi in ((0, 3), (3, 4), (4, 5)):
            params.pre_step(OrderedDict(a=hi - lo))
            mask = "self_attn_mask_type" if isinstance(block, te.TransformerLayer) else "attn_mask_type"
            out = block(x[:, lo:hi], inference_params=params, **{mask: "padding_causal"})
            steps.append(out[0] if isinstance(out, tuple) else out)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1.3e-6, atol=1e-5)


def test_paged_cache_holds_what_the_non_paged_one_holds():
    """The same steps into a paged and a non-paged cache: the paged one, read through its page
    table, holds the same keys and values; sequences never share a page."""
    torch.manual_seed(4)
    flat, paged = _params(), _params(paged=True)
    shape = (GROUPS, HIDDEN // HEADS)
    for step in (OrderedDict(a=6, b=3), OrderedDict(a=1, b=1), OrderedDict(b=2, c=5)):
        k = torch.randn(1, sum(step.values()), *shape)
        k = torch.nn.utils.rnn.pad_sequence(list(k[0].split(list(step.values()))), batch_first=True)
        for params in (flat, paged):
            params.pre_step(step)
        k_flat, _, cu_q, cu_kv, _, _ = flat.step(1, k, k.clone(), "bshd")
        k_pages, _, cu_q2, cu_kv2, _, _ = paged.step(1, k, k.clone(), "bshd")
        assert k_pages.shape == (8, 4, *shape) and torch.equal(cu_q, cu_q2) and torch.equal(cu_kv, cu_kv2)
        rows, _ = paged.convert_paged_to_nonpaged(1)
        for j, total in enumerate(flat.sequences.values()):
            torch.testing.assert_close(rows[j, :total], k_flat[j, :total], rtol=0, atol=0)
    b_pages, c_pages = (set(row[:2]) for row in paged.page_table.tolist())
    assert paged.page_table.shape == (2, 4) and not b_pages & c_pages


def test_token_counts_of_any_integer_type():
    """numpy's integers and 0-d integer tensors (what code counting with tensors passes, as
    Transformer Engine's examples do) count as Python's ints."""
    import numpy as np

    layouts = []
    for counts in ((3, 2), (np.int64(3), np.int32(2)), (torch.tensor(3), torch.tensor(2, dtype=torch.int32))):
        params = _params()
        params.pre_step(OrderedDict(zip("ab", counts)))
        assert params.step_lens == [3, 2] and all(type(n) is int for n in params.step_lens)
        layouts.append((params.cu_seqlens_q, params.cu_seqlens_kv, params.pre_step_seqlens))
    for layout in layouts[1:]:
        assert all(torch.equal(t, w) for t, w in zip(layout, layouts[0]))


def test_bad_steps_and_inputs_say_what_is_wrong():
    params = _params()
    with pytest.raises(ValueError, match="sequence 'a' brings 0 tokens; give a positive integer"):
        params.pre_step(OrderedDict(a=0))
    for bad in (2.0, torch.tensor(2.0), torch.tensor([2]), True):
        with pytest.raises(ValueError, match="sequence 'a' brings .* tokens; give a positive integer"):
            params.pre_step(OrderedDict(a=bad))
    params.pre_step(OrderedDict(a=3, b=2))
    with pytest.raises(ValueError, match=r"2 sequences bringing up to 3 tokens, but the bshd input has shape \(2, 2"):
        params.packed_tokens(torch.randn(2, 2, GROUPS, HIDDEN // HEADS), "bshd")
    with pytest.raises(ValueError, match="the step's sequences bring 5 tokens, but the packed input holds 4"):
        params.packed_tokens(torch.randn(4, GROUPS, HIDDEN // HEADS), "thd")
    new = torch.randn(5, GROUPS + 1, HIDDEN // HEADS)
    with pytest.raises(ValueError, match=r"the new keys have shape \(5, 3, 8\), but the cache holds \(tokens, 2, 8\)"):
        params.cached_step(1, new, new)
    with pytest.raises(ValueError, match="this cache is not paged"):
        params.convert_paged_to_nonpaged(1)


def test_a_refused_step_changes_nothing():
    params = _params()
    params.pre_step(OrderedDict(a=10))
    with pytest.raises(ValueError, match="would hold 17 tokens"):
        params.pre_step(OrderedDict(a=7, b=1))
    assert params.sequences == OrderedDict(a=10) and params.get_seqlens_pre_step().tolist() == [0]


# sequences finish and join, prompts of other lengths come in the same padded step as decoding
# sequences, rows past the step's sequences are padding: (sequence: tokens) per step
SCHEDULE = [OrderedDict(a=3, b=4), OrderedDict(a=1, b=1), OrderedDict(a=1, b=1), OrderedDict(b=1, c=4),
            OrderedDict(b=1, c=1), OrderedDict(b=1, c=1, d=1), OrderedDict(d=1)]
PREFILL = 4  # the padded length of a step bringing a prompt (a decode step brings one token)


def _generation_setup(fmt, seed):
    """(a layer in eval mode, its rotary embedding, four sequences' tokens) for SCHEDULE."""
    layer = _layer(fmt)
    layer.eval()
    torch.manual_seed(seed)
    return layer, tm.RotaryPositionEmbedding(HIDDEN // HEADS)(16), {name: torch.randn(10, HIDDEN) for name in "abcd"}


def _fixed_shape_generation(step, fmt, paged, seqs, freqs):
    """Run SCHEDULE through step(x, params, fixed) twice: eagerly (the step's sequences' rows, as
    long as its longest) and at fixed shapes (max_batch_size rows, PREFILL or 1 tokens, the
    padding random); returns each run's outputs of the sequences' tokens and caches."""
    runs = {}
    for mode in ("eager", "fixed"):
        params, done, outs = _params(fmt, max_batch_size=3, paged=paged), dict.fromkeys(seqs, 0), []
        for i, lengths in enumerate(SCHEDULE):
            params.pre_step(lengths)
            rows = [seqs[name][done[name]:done[name] + n] for name, n in lengths.items()]
            s = PREFILL if max(lengths.values()) > 1 else 1
            # padding: noise (drawn on the CPU from a seeded CPU generator, then put where the rows are)
            noise = torch.randn(3, s, HIDDEN, generator=torch.Generator().manual_seed(i), device="cpu").to(
                rows[0].device)
            if mode == "eager":
                x = _to_format(rows, fmt)
            elif fmt == "thd":  # 3 * s packed tokens: the sequences' first, then padding
                x = torch.cat(rows + [noise.flatten(0, 1)])[:3 * s]
            else:
                for row, r in enumerate(rows):
                    noise[row, :len(r)] = r
                x = noise.transpose(0, 1) if fmt == "sbhd" else noise
            out = step(x, params, mode == "fixed")
            if fmt == "thd":
                out = out[:sum(lengths.values())]
            outs += _from_format(out, list(lengths.values()), fmt)
            for name, n in lengths.items():
                done[name] += n
        runs[mode] = outs, [t.clone() for t in params.cache[LAYER]]
    return runs


@pytest.mark.parametrize("fmt, paged", [("bshd", False), ("sbhd", False), ("thd", False), ("bshd", True),
                                        ("sbhd", True), ("thd", True)])
def test_compiled_generation_steps_equal_eager(fmt, paged):
    """A generation step under torch.compile(fullgraph=True): rows padded to max_batch_size, so
    one graph per step length serves every step (no recompilation as sequences finish and join:
    the layout is read from buffers pre_step refills), and the sequences' outputs and the KV
    cache equal the eager steps'."""
    layer, freqs, seqs = _generation_setup(fmt, seed=4)
    torch._dynamo.reset()  # each case compiles its own step (the same code object)
    compiled = torch.compile(lambda x, params: layer(x, rotary_pos_emb=freqs, inference_params=params),
                             backend="aot_eager", fullgraph=True, dynamic=False)
    seen = set()

    def step(x, params, fixed):
        with torch.no_grad():
            if not fixed:
                return layer(x, rotary_pos_emb=freqs, inference_params=params)
            if LAYER not in params.cache:  # a compiled step finds the caches made
                params.allocate_memory(LAYER)
            with torch._dynamo.config.patch(error_on_recompile=x.shape in seen):
                seen.add(x.shape)
                return compiled(x, params)

    runs = _fixed_shape_generation(step, fmt, paged, seqs, freqs)
    (got, got_cache), (want, want_cache) = runs["fixed"], runs["eager"]
    assert len(seen) == 2 and len(got) == len(want) == sum(len(s) for s in SCHEDULE)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    for g, w in zip(got_cache, want_cache):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("fmt, paged", [("bshd", False), ("sbhd", True), ("thd", False)])
def test_generation_steps_inside_a_capture_read_nothing_on_the_host(monkeypatch, fmt, paged):
    """Inside te.make_graphed_callables (its warm-up and capture) a generation step takes the
    fixed-shape path and reads no tensor value on the host, so a CUDA graph replays it with the
    layout each pre_step writes into its buffers; its outputs and cache equal the eager steps'."""
    from te_core.modules import inference, rope
    from te_core.quantization.scaling import graph_capture

    layer, freqs, seqs = _generation_setup(fmt, seed=5)

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    def step(x, params, fixed):
        with torch.no_grad():
            if not fixed:
                return layer(x, rotary_pos_emb=freqs, inference_params=params)
            if LAYER not in params.cache:  # as a warm-up before the capture makes it
                params.allocate_memory(LAYER)
            with monkeypatch.context() as patched, graph_capture():
                for where in (rope, inference):  # as a capturing stream makes it answer
                    patched.setattr(where, "host_readable", lambda t: False)
                for method in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
                    patched.setattr(torch.Tensor, method, host_read)
                return layer(x, rotary_pos_emb=freqs, inference_params=params)

    runs = _fixed_shape_generation(step, fmt, paged, seqs, freqs)
    (got, got_cache), (want, want_cache) = runs["fixed"], runs["eager"]
    for g, w in zip(got + got_cache, want + want_cache):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.reference_only  # on an accelerator a failed device check is a device-side assertion
def test_fixed_shape_generation_steps_say_what_is_wrong():
    """Where a compiled or captured step cannot run as asked, it says why and what to do: more
    rows than max_batch_size, a cache a compiled step would have to allocate; and the device
    checks that the input (padded or packed) holds the step's sequences."""
    from te_core.quantization.scaling import graph_capture

    mha = {fmt: tm.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, layer_number=1,
                                      attn_mask_type="padding_causal", qkv_format=fmt) for fmt in ("bshd", "thd")}
    params = _params(max_batch_size=2)
    params.pre_step(OrderedDict(a=3, b=2))
    with torch.no_grad(), graph_capture():
        with pytest.raises(RuntimeError, match=r"pre_step's sequences bring more tokens than the packed input holds "
                                               r"\(4\)"):
            mha["thd"](torch.randn(4, HIDDEN), inference_params=params)
        with pytest.raises(ValueError, match="the input holds 3 sequences, more than max_batch_size=2"):
            mha["bshd"](torch.randn(3, 4, HIDDEN), inference_params=params)
        with pytest.raises(RuntimeError, match="pre_step's sequences must fit the input: at most 1 of them"):
            mha["bshd"](torch.randn(1, 4, HIDDEN), inference_params=params)
        with pytest.raises(RuntimeError, match="bringing at most 2 tokens each"):
            mha["bshd"](torch.randn(2, 2, HIDDEN), inference_params=params)
    fresh = _params(max_batch_size=2)
    fresh.pre_step(OrderedDict(a=1))
    compiled = torch.compile(lambda x: mha["bshd"](x, inference_params=fresh), backend="aot_eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match=r"layer 1's KV cache does not exist yet, and a compiled or "
                                                         r"captured step cannot allocate it"):
        compiled(torch.randn(2, 1, HIDDEN))


def test_caches_are_static_inputs_once_compile_is_in_use():
    """Once torch.compile is in use, pre_step and allocate_memory mark the layout buffer and
    the caches' storage as static inputs (torch._dynamo.mark_static_address), so that CUDA
    graphs (mode="reduce-overhead") replay the step's in-place cache writes."""
    import torch._dynamo  # what torch.compile imports

    params = _params(max_batch_size=2)
    params.allocate_memory(LAYER)
    params.pre_step(OrderedDict(a=2))
    params.allocate_memory(LAYER + 1)  # a layer made after the step
    marked = [params._layout, *params._storage[LAYER], *params._storage[LAYER + 1]]
    assert all(getattr(t, "_dynamo_static_input_type", None) is not None for t in marked)
