"""The `te-core` command: `te-core info [--json]`, `te-core demo [...]`."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="te-core", description="te-core: multi-vendor Transformer Engine for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="installed backends, availability, capabilities, op coverage")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("demo", help="train a small GPT in BF16 then FP8 and compare (te-core demo --help)", add_help=False)
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = parser.parse_args(argv)
    from . import info as info_module

    return info_module.main(as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
