"""`te-core demo`: train the same small GPT in BF16 and then in FP8, and compare the losses."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import List, Optional

import torch

from .data import load_corpus, split, stdlib_dir
from .model import SIZES
from .report import final_gap, output_paths, side_by_side, write_json, write_plot
from .train import RECIPES, RunConfig, make_recipe, train

DEFAULT_STEPS = {"tiny": 60, "small": 250, "medium": 600, "large": 2000}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="te-core demo",
        description="Train a small GPT (te-core modules) on the Python standard library's source, "
        "in BF16 and then in FP8, and compare the loss curves.",
    )
    p.add_argument(
        "--recipe", choices=RECIPES, default="delayed", help="FP8 recipe of the second run (default: delayed)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: by --size)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="model size (default: small, a few minutes on 2 CPU cores)",
    )
    p.add_argument("--backend", default=None, help="te-core backend (default: TE_BACKEND or auto)")
    p.add_argument("--device", default=None, help="torch device to train on (default: the backend's device)")
    p.add_argument("--out", default="demo-out", help="directory for loss_curves.png and demo_run.json")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: by --size)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """`te-core demo [options]`: returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.steps is not None and args.steps < 2:
        print("te-core demo: --steps must be at least 2", file=sys.stderr)
        return 2
    from .. import backend

    try:
        be = backend.set_backend(args.backend) if args.backend else backend.get_backend()
    except backend.BackendError as err:
        print(f"te-core demo: --backend {args.backend}: {err}", file=sys.stderr)
        return 2
    device = torch.device(args.device) if args.device else be.device
    fp8_recipe = make_recipe(args.recipe)
    steps = args.steps or DEFAULT_STEPS[args.size]
    lr = args.lr or (1e-3 if args.size in ("medium", "large") else 2e-3)
    cfg = RunConfig(model=SIZES[args.size], steps=steps, lr=lr, seed=args.seed)
    tokens_per_step = cfg.model.batch_size * cfg.model.seq_len
    tokens, files = load_corpus(max_bytes=max(2_000_000, 40 * steps * tokens_per_step // 100))
    train_tokens, val_tokens = split(tokens)
    print(
        f"te-core demo: backend {be.name} on {device}, size {args.size} {cfg.model.as_dict()}, {steps} steps, "
        f"recipe {args.recipe}; corpus {tokens.numel() / 1e6:.1f} MB from {files} files under {stdlib_dir()}"
    )
    runs = []
    for name, rec in (("bf16", None), ("fp8", fp8_recipe)):
        run = train(name, cfg, train_tokens, val_tokens, device, fp8_recipe=rec, progress=not args.no_progress)
        print(
            f"{name}: {run.seconds:.1f}s, {run.tokens_per_s:,.0f} tokens/s, final loss {run.losses[-1]:.4f}, "
            f"val loss {run.val_loss:.4f}"
        )
        runs.append(run)
    report(
        args, cfg, be.name, device, fp8_recipe, runs, corpus=dict(bytes=tokens.numel(), files=files, root=stdlib_dir())
    )
    return 0


def report(args, cfg: RunConfig, backend_name: str, device, fp8_recipe, runs, corpus: dict) -> None:
    """Print the curves side by side and the gap; write the PNG and the JSON of the run."""
    hp, fp8 = runs
    gap = final_gap(hp.losses, fp8.losses)
    gap["val_gap"] = fp8.val_loss - hp.val_loss
    print(side_by_side(hp.losses, fp8.losses))
    print(
        f"loss over the last {gap['steps_averaged']} steps: bf16 {gap['bf16']:.4f}, fp8 {gap['fp8']:.4f}, "
        f"gap {gap['gap']:+.4f} ({100 * gap['relative_gap']:+.2f}%); val gap {gap['val_gap']:+.4f}"
    )
    paths = output_paths(args.out)
    drawn_by = write_plot(paths["png"], hp.losses, fp8.losses, args.recipe)
    config = dict(size=args.size, model=cfg.model.as_dict(), steps=cfg.steps, lr=cfg.lr, seed=cfg.seed,
                  recipe=args.recipe, recipe_repr=repr(fp8_recipe))  # fmt: skip
    record = dict(
        config=config, backend=backend_name, device=str(device), recipe=args.recipe,
        versions=dict(python=platform.python_version(), torch=torch.__version__), corpus=corpus,
        runs={run.name: run.as_dict() for run in runs}, final_gap=gap, plot=dict(path=paths["png"], drawn_by=drawn_by),
    )  # fmt: skip
    write_json(paths["json"], record)
    print(f"wrote {paths['png']} and {paths['json']}")
