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


def _refuse_gpu_tests_beside(items, here: str) -> None:
    """Stop a run that collected tests from elsewhere on a machine with a GPU: the interpreter,
    turned on above for the whole process, would run their kernels on GPU tensors."""
    import torch

    others = [item for item in items if not str(item.fspath).startswith(here)
              and os.sep + os.path.join("musa", "tests") not in str(item.fspath)]
    if others and torch.cuda.is_available():
        raise pytest.UsageError(
            f"backends/triton/tests turns on Triton's CPU interpreter (TRITON_INTERPRET=1) for the whole pytest "
            f"process, which would run the GPU kernels of the other tests collected with it ({others[0].nodeid}, "
            "...) through the interpreter. Run backends/triton/tests in a pytest process of its own, as "
            "scripts/test.sh does")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    _refuse_gpu_tests_beside(items, here)
    why = _interpreter_runs_program_loops()
    if why:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=why))
