"""Real training speed: a Hugging Face LlamaForCausalLM (built from a LlamaConfig, random
initialization, nothing downloaded) trained with AdamW as plain-torch bf16, and converted with
te.convert_model as te bf16 and te FP8 per recipe, eager and torch.compile'd, all cells in one
process, so each FP8/BF16 ratio compares runs of the same machine state.

Models: 4 layers, heads hidden/128, intermediate 3.5x hidden (a multiple of 64), vocab 32000,
seq 2048, at hidden 1024 / 2048 / 4096, with a batch that makes each step last tens of ms on
an H200. te cells convert every nn.Linear and RMSNorm except the LM head, which stays in bf16
(Transformer Engine's usual choice: the logits' GEMM is the least tolerant of FP8); FP8 runs
the forward and the loss under te.autocast(recipe=...). A cell times whole training steps
(forward, loss, backward, AdamW) after a few warm-up steps that also compile: "compiled" is
torch.compile of the loss step in inductor's default mode, "graphed" is mode="reduce-overhead"
(CUDA graphs), "captured" is te.make_graphed_callables over the decoder layers (FP8 for te's
recipes, high precision for the bf16 variants; the keyword arguments the model passes its
layers given as sample_kwargs), the embedding, final norm, LM head, loss and optimizer eager.
Eager cells of every size run first, then compiled, then graphed; a cell that
raises records its error and the run goes on; cells reached after --budget-s are recorded as
skipped; the JSON is rewritten after every cell. A loss that is not finite is recorded as the
cell's error (beside its speed).

    python benchmarks/bench_hf.py [--hidden 1024,2048,4096] [--modes eager,compiled,graphed,captured]
                                  [--recipes delayed,current] [--budget-s 200] [--results DIR] [--merge]
    python benchmarks/bench_hf.py --smoke --results /tmp/r   # CPU, reference backend, a tiny Llama

transformers is not a dependency of te-core: install it to run this benchmark. Writes
RESULTS/<gpu>/hf.json; `python benchmarks/report.py` renders it into docs/performance.md.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
from _results import add_results_argument, gpu_slug, meta, select_device, write_json
from _timing import synchronize
from bench_sweep import Cell, merged, run

import te_core as te
from te_core import recipe

SECTION = "hf"
MODES = ("eager", "compiled", "graphed", "captured")
COMPILE_KW = {"eager": None, "compiled": {}, "graphed": {"mode": "reduce-overhead"}, "captured": None}
FP8_RECIPES: Dict[str, Callable[[], recipe.Recipe]] = {
    "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling}
MISSING_TRANSFORMERS = ("bench_hf.py trains a Hugging Face Llama and needs the transformers package, which te-core "
                        "does not depend on: pip install transformers")


@dataclasses.dataclass(frozen=True)
class Sizes:
    models: tuple = ((1024, 16), (2048, 8), (4096, 4))  # (hidden, batch)
    layers: int = 4
    seq: int = 2048
    vocab: int = 32000
    head_dim: int = 128
    warmup: int = 3  # steps before timing: the compile, and CUDA graph recording under "graphed"
    steps: int = 8


FULL = Sizes()
SMOKE = Sizes(models=((64, 2),), layers=2, seq=32, vocab=256, head_dim=32, warmup=1, steps=2)


def intermediate_size(hidden: int) -> int:
    """3.5x hidden, rounded to a multiple of 64 (so every GEMM dimension suits FP8)."""
    return max(64, round(3.5 * hidden / 64) * 64)


def label(hidden: int, batch: int, sizes: Sizes) -> str:
    return (f"h{hidden} ffn{intermediate_size(hidden)} nh{hidden // sizes.head_dim} L{sizes.layers} "
            f"s{sizes.seq} b{batch}")


def loss_of(model, input_ids: torch.Tensor, rcp: Optional[recipe.Recipe]) -> torch.Tensor:
    """The causal-LM loss (transformers shifts the labels); FP8 under te.autocast when `rcp` is given."""
    with te.autocast(recipe=rcp) if rcp is not None else contextlib.nullcontext():
        return model(input_ids=input_ids, labels=input_ids).loss


def capture_layers(model, rcp: Optional[recipe.Recipe], input_ids: torch.Tensor) -> None:
    """te.make_graphed_callables over the model's decoder layers, in FP8 under `rcp` (None: high
    precision), with the keyword arguments the model passes them (rotary cos/sin, position ids,
    the flags), recorded from one forward without gradients. The gradients are allocated
    beforehand, so that autograd accumulates into them instead of keeping the graphs' buffers."""
    layers = model.model.layers
    seen = {}
    hook = layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.update(args=args, kwargs=kwargs),
                                               with_kwargs=True)
    try:
        with torch.no_grad():
            loss_of(model, input_ids, rcp)
    finally:
        hook.remove()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hidden = seen["args"][0]
    samples = tuple((torch.randn_like(hidden).requires_grad_(),) for _ in layers)
    te.make_graphed_callables(tuple(layers), samples, sample_kwargs=tuple(dict(seen["kwargs"]) for _ in layers),
                              enabled=rcp is not None, recipe=rcp, clone_param_grads_on_return=False)


class Bench:
    """Builds the cells; each trains a freshly built model (the same weights for every cell of
    one size), so no cell inherits another's optimizer or FP8 state."""

    def __init__(self, transformers, sizes: Sizes, device: str, smoke: bool):
        self.transformers, self.sizes, self.device, self.smoke = transformers, sizes, device, smoke
        self.attention = None  # the attention implementation transformers chose (e.g. "sdpa"), once a model exists

    def build(self, hidden: int):
        s = self.sizes
        cfg = self.transformers.LlamaConfig(
            vocab_size=s.vocab, hidden_size=hidden, intermediate_size=intermediate_size(hidden),
            num_hidden_layers=s.layers, num_attention_heads=hidden // s.head_dim,
            num_key_value_heads=hidden // s.head_dim, max_position_embeddings=s.seq, use_cache=False)
        torch.manual_seed(0)
        with torch.device(self.device):  # initialized on the device: a 1B-parameter init on the host takes long
            model = self.transformers.LlamaForCausalLM(cfg)
        self.attention = model.config._attn_implementation
        return model.to(torch.bfloat16).train()

    def variant(self, model, name: str) -> Optional[recipe.Recipe]:
        """Convert `model` for variant `name` ("torch bf16", "te bf16", "te <recipe>"); its recipe."""
        if name == "torch bf16":
            return None
        rcp = None if name == "te bf16" else FP8_RECIPES[name.split()[1]]()
        te.convert_model(model, rcp, skip=("lm_head",))
        return rcp

    def train_step(self, model, rcp, mode: str, input_ids):
        kw = COMPILE_KW[mode]
        if kw is not None and self.smoke:
            kw = {**kw, "backend": "eager"}  # dynamo's tracing without inductor's code generation: fast on a CPU
        if kw is not None and rcp is not None:
            te.init_quantization_state(model, rcp)  # delayed scaling's state must exist before the first trace
        if mode == "captured":
            capture_layers(model, rcp, input_ids)
        if kw is not None:
            # each cell compiles afresh: dynamo's cache of loss_of would carry the earlier cells'
            # graphs, retrace this one with the sizes that changed made symbolic (automatic dynamic
            # shapes) and, past its cache limit, run the step eagerly
            torch._dynamo.reset()
        loss_step = loss_of if kw is None else torch.compile(loss_of, **kw)
        fused = torch.device(self.device).type == "cuda"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

        def step() -> torch.Tensor:
            if mode == "graphed":  # a replay overwrites the previous step's outputs: mark each step
                torch.compiler.cudagraph_mark_step_begin()
            loss = loss_step(model, input_ids, rcp)
            # captured layers' gradients must not alias the graphs' buffers: zeroed, never dropped
            optimizer.zero_grad(set_to_none=mode != "captured")
            loss.backward()
            optimizer.step()
            return loss.detach().clone()

        return step

    def measure(self, hidden: int, batch: int, name: str, mode: str) -> dict:
        gc.collect()  # the previous cell's model and optimizer are gone before this one allocates
        cuda = torch.device(self.device).type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = self.build(hidden)
        rcp = self.variant(model, name)
        tokens = torch.Generator(self.device).manual_seed(1)  # the same batch in every cell of a size
        input_ids = torch.randint(0, self.sizes.vocab, (batch, self.sizes.seq), device=self.device, generator=tokens)
        step = self.train_step(model, rcp, mode, input_ids)
        t0 = time.perf_counter()
        losses = [step() for _ in range(self.sizes.warmup)]
        synchronize(self.device)
        t1 = time.perf_counter()
        losses += [step() for _ in range(self.sizes.steps)]
        synchronize(self.device)
        seconds = time.perf_counter() - t1
        losses = [float(x) for x in losses]
        result = {"tokens_per_s": batch * self.sizes.seq * self.sizes.steps / seconds,
                  "ms": 1e3 * seconds / self.sizes.steps, "warmup_s": round(t1 - t0, 2),
                  "loss_first": losses[0], "loss_last": losses[-1]}
        if cuda:
            result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if not all(math.isfinite(x) for x in losses):
            result["error"] = f"loss is not finite: {losses}"
        return result

    def cells(self, hidden_sizes, modes, variants) -> List[Cell]:
        """Every mode's cells of every size before the next mode's: the budget cuts the slowest
        (compiling) cells, never the eager baselines."""
        return [Cell(SECTION, label(h, b, self.sizes), f"{name} {mode}", partial(self.measure, h, b, name, mode))
                for mode in modes for h, b in self.sizes.models if h in hidden_sizes for name in variants]


def previous_rows(meta_now: dict, root: str) -> Tuple[dict, Optional[str]]:
    """The rows of this GPU's existing hf.json and the date of its run ({}, None when there is none)."""
    path = os.path.join(root, gpu_slug(meta_now["gpu"]), f"{SECTION}.json")
    if not os.path.exists(path):
        return {}, None
    with open(path) as f:
        data = json.load(f)
    return {SECTION: data.get(SECTION, {})}, data.get("meta", {}).get("date")


def _csv(text: str) -> List[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default=None, help="comma-separated hidden sizes of 1024, 2048, 4096 (default: all)")
    ap.add_argument("--modes", default=None, help="comma-separated of eager, compiled, graphed, captured (default: "
                    "all; eager,compiled with --smoke)")
    ap.add_argument("--recipes", default="delayed,current", help=f"FP8 recipes, of {', '.join(FP8_RECIPES)}")
    ap.add_argument("--smoke", action="store_true", help="CPU, reference backend, a tiny Llama (for the unit test)")
    ap.add_argument("--merge", action="store_true", help="keep the cells of an existing hf.json that this run does "
                    "not measure (to split the benchmark over several runs)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="cells reached after this many seconds are skipped")
    add_results_argument(ap)
    args = ap.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    known = [h for h, _ in sizes.models]
    hidden = _csv(args.hidden) if args.hidden else [str(h) for h in known]
    if not all(h.isdigit() for h in hidden):
        ap.error(f"--hidden: expected comma-separated integers such as 1024,2048, got {args.hidden!r}")
    args.hidden = [int(h) for h in hidden]
    args.modes = _csv(args.modes) if args.modes else list(MODES[:2] if args.smoke else MODES)
    args.recipes = _csv(args.recipes)
    for what, got, allowed in (("--hidden", args.hidden, known), ("--modes", args.modes, MODES),
                               ("--recipes", args.recipes, list(FP8_RECIPES))):
        unknown = [str(x) for x in got if x not in allowed]
        if unknown:
            ap.error(f"{what}: unknown {', '.join(unknown)}; choose from {', '.join(map(str, allowed))}")
    for mode in ("graphed", "captured"):
        if args.smoke and mode in args.modes:
            ap.error(f"--modes {mode} needs CUDA graphs, so a GPU: leave it out with --smoke")
    return args, sizes


def main(argv=None) -> dict:
    args, sizes = parse_args(argv)
    try:
        import transformers
    except ImportError:
        raise SystemExit(MISSING_TRANSFORMERS) from None
    device = select_device(args.smoke, "bench_hf.py")
    variants = ["torch bf16", "te bf16"] + [f"te {r}" for r in args.recipes]
    bench = Bench(transformers, sizes, device, args.smoke)
    cells = bench.cells(args.hidden, args.modes, variants)
    t0 = time.monotonic()
    settings = {"sizes": dataclasses.asdict(sizes), "modes": args.modes, "variants": variants,
                "backend": te.get_backend().name, "transformers": transformers.__version__,
                "budget_s": args.budget_s}
    head = {"meta": meta(device), "settings": settings}
    earlier, earlier_date = previous_rows(head["meta"], args.results) if args.merge else ({}, None)
    if earlier:  # the report says which cells may come from another run
        settings["merged_with"] = earlier_date

    def save(results):
        settings["seconds"] = round(time.monotonic() - t0, 1)
        settings["attention"] = bench.attention
        return write_json(SECTION, {**head, **merged(earlier, results)}, args.results)

    results = run(cells, args.budget_s, device, save)
    print(f"wrote {save(results)} in {settings['seconds']} s")
    return {**head, **results}


if __name__ == "__main__":
    main()
