"""Run the Triton kernels on the CPU through Triton's interpreter (set before triton loads).

te_triton's kernels loop with `range(tl.program_id(0), n, tl.num_programs(0))`. Some triton
versions' interpreters (3.6's) cannot run that loop: they fail to turn program_id into a
Python int. Where the installed interpreter cannot, these tests are skipped with that reason;
the kernels are then tested on the GPU (backends/cuda/tests, the conformance kit).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def _interpreter_runs_program_loops() -> str:
    """'' if the interpreter runs a program_id-strided loop, else why not."""
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError as exc:
        return f"triton is not importable: {exc}"

    @triton.jit
    def _probe(out_ptr, n):
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(out_ptr + i, i)

    out = torch.zeros(4, dtype=torch.int32)
    try:
        _probe[(2,)](out, 4)
    except Exception as exc:  # the interpreter's own error, whatever its type
        return (f"triton {triton.__version__}'s interpreter cannot run a program_id-strided loop "
                f"({type(exc).__name__}: {str(exc)[:120]}); install a newer triton to run these on the CPU")
    if out.tolist() != [0, 1, 2, 3]:
        return f"triton {triton.__version__}'s interpreter ran a program_id-strided loop wrongly: {out.tolist()}"
    return ""


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    why = _interpreter_runs_program_loops()
    if why:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=why))
