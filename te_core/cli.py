"""The `te-core` command: info, demo, new-backend, certify, --version.

A configuration mistake (an unknown backend, a bad TE_BACKEND_* value) is printed as one
message with a non-zero exit code, never as a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command ended by SIGPIPE (128 + 13)


def version_line() -> str:
    import platform

    import torch

    from . import __version__

    return f"te-core {__version__} (torch {torch.__version__}, python {platform.python_version()})"


class _Version(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print te-core's, torch's and python's versions")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="te-core", description="te-core: multi-vendor Transformer Engine for PyTorch")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="installed backends, availability, capabilities, op coverage")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("demo", help="train a small GPT in BF16 then FP8 and compare (te-core demo --help)", add_help=False)
    new = sub.add_parser("new-backend", help="write a renamed, installable copy of the backend template")
    new.add_argument("name", help="backend name (lower case, e.g. acme): package te_backend_NAME, entry point NAME")
    new.add_argument("--dest", metavar="DIR", help="directory to create (default: ./te-backend-NAME)")
    new.add_argument("--template", metavar="DIR", help="template to copy (default: te-core's plugins/template)")
    certify = sub.add_parser("certify", help="run the conformance kit against a backend and print its op coverage",
                             description="Extra arguments after NAME go to pytest (e.g. -x, -k gemm).")
    certify.add_argument("name", help="installed backend to certify")
    return parser


def _run(argv: List[str]) -> int:
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args, extra = _parser().parse_known_args(argv)
    if extra and args.command != "certify":
        _parser().error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "new-backend":
        from .commands import new_backend

        return new_backend.main(args.name, args.dest, args.template)
    if args.command == "certify":
        from .commands import certify as certify_command

        return certify_command.main(args.name, extra)
    from . import info as info_module

    return info_module.main(as_json=args.json)


def main(argv: Optional[List[str]] = None) -> int:
    from .backend.plugin import BackendError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's flush at exit
        return status
    except BackendError as exc:
        print(f"te-core: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader quit early (`te-core info | head`): nothing went wrong here
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # a path the user gave that cannot be written (new-backend --dest, demo --out)
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"te-core: error: cannot write{where}: {exc.strerror or exc}; give a directory you can write to",
              file=sys.stderr)
        return EXIT_USAGE


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail on the
    closed pipe again and print a traceback."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a file descriptor (captured): nothing to flush into a pipe
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
