"""Generation with a KV cache replayed as CUDA graphs, on the GPU only: a decode step captured
once (torch.cuda.graph, warmed up as te.make_graphed_callables warms up) and replayed while
sequences finish and join, and the same step under torch.compile(mode="reduce-overhead"),
give the eager steps' outputs and caches (te_core.InferenceParams.fixed_shape_step)."""
from collections import OrderedDict

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core.quantization.scaling import graph_capture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, HEADS, GROUPS, LAYER, ROWS, MAX_LEN = 64, 4, 2, 1, 3, 32
TOL = dict(rtol=1e-5, atol=1e-5)
# after a prefill of a and b (run eagerly in both runs), one new token per sequence per step
DECODE = [OrderedDict(a=1, b=1), OrderedDict(a=1, b=1), OrderedDict(b=1), OrderedDict(b=1, c=1),
          OrderedDict(b=1, c=1, d=1), OrderedDict(c=1, d=1)]
PREFILL = OrderedDict(a=3, b=5)


@pytest.fixture(autouse=True)
def cuda_backend():
    previous = te.get_backend().name
    te.set_backend("cuda")
    with torch.device("cuda"):
        yield
    te.set_backend(previous)


def _setup(fmt="bshd"):
    torch.manual_seed(0)
    layer = tm.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal", layer_number=LAYER,
                                attn_input_format=fmt, params_dtype=torch.float32).eval()
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(MAX_LEN)
    tokens = {name: torch.randn(12, HIDDEN) for name in "abcd"}
    return layer, freqs, tokens


def _params():
    return te.InferenceParams(ROWS, MAX_LEN, num_heads_kv=GROUPS, head_dim_k=HIDDEN // HEADS, dtype=torch.float32)


def _rows(tokens, step, done):
    return [tokens[name][done[name]:done[name] + n] for name, n in step.items()]


def _generate(layer, freqs, tokens, run_decode):
    """Eager prefill, then DECODE through run_decode(x (ROWS, 1, HIDDEN), params) -> output,
    the input's rows past the step's sequences random; returns the sequences' decode outputs
    and the layer's caches."""
    params, done, outs = _params(), dict.fromkeys(tokens, 0), []
    with torch.no_grad():
        params.pre_step(PREFILL)
        layer(torch.nn.utils.rnn.pad_sequence(_rows(tokens, PREFILL, done), batch_first=True),
              rotary_pos_emb=freqs, inference_params=params)
        for name, n in PREFILL.items():
            done[name] += n
        for step in DECODE:
            params.pre_step(step)
            x = torch.randn(ROWS, 1, HIDDEN)
            x[:len(step)] = torch.stack(_rows(tokens, step, done))
            out = run_decode(x, params)
            outs += [out[i].clone() for i in range(len(step))]
            for name in step:
                done[name] += 1
    return outs, [t.clone() for t in params.cache[LAYER]]


def _eager_decode(layer, freqs):
    return lambda x, params: layer(x[:params.batch_size], rotary_pos_emb=freqs, inference_params=params)


def _assert_same(got, want):
    (got_out, got_cache), (want_out, want_cache) = got, want
    assert len(got_out) == len(want_out) == sum(len(step) for step in DECODE)
    for g, w in zip(got_out + got_cache, want_out + want_cache):
        torch.testing.assert_close(g, w, **TOL)


def test_decode_step_captured_once_replays_every_step():
    layer, freqs, tokens = _setup()
    want = _generate(layer, freqs, tokens, _eager_decode(layer, freqs))
    graph, static = None, {}

    def captured(x, params):
        nonlocal graph
        if graph is None:  # the first decode step: warm up (as make_graphed_callables does), capture
            static["x"] = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), graph_capture():
                for _ in range(2):  # rewrites this step's tokens into the cache: the replay writes them again
                    layer(static["x"], rotary_pos_emb=freqs, inference_params=params)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["out"] = layer(static["x"], rotary_pos_emb=freqs, inference_params=params)
        static["x"].copy_(x)
        graph.replay()
        return static["out"]

    _assert_same(_generate(layer, freqs, tokens, captured), want)


def test_decode_step_compiled_with_cuda_graphs():
    layer, freqs, tokens = _setup()
    want = _generate(layer, freqs, tokens, _eager_decode(layer, freqs))
    torch._dynamo.reset()
    step = torch.compile(lambda x, params: layer(x, rotary_pos_emb=freqs, inference_params=params),
                         mode="reduce-overhead", fullgraph=True, dynamic=False)

    def compiled(x, params):
        torch.compiler.cudagraph_mark_step_begin()
        return step(x, params).clone()

    _assert_same(_generate(layer, freqs, tokens, compiled), want)
