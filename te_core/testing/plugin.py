"""pytest plugin of the conformance kit: the ``--te-backend`` option and its fixtures.

Loaded in every pytest session through te-core's ``pytest11`` entry point, so it imports
nothing heavy at load time: the registry is only touched when a kit fixture is used.
"""
from __future__ import annotations

import pytest

DEFAULT_BACKEND = "reference"


def pytest_addoption(parser):
    group = parser.getgroup("te-core", "te-core backend conformance kit")
    group.addoption(
        "--te-backend",
        action="store",
        default=DEFAULT_BACKEND,
        metavar="NAME",
        help="backend to certify with `pytest --pyargs te_core.testing` (default: %(default)s)",
    )


@pytest.fixture(scope="session")
def te_backend_name(request) -> str:
    """The name given with --te-backend."""
    return request.config.getoption("--te-backend")


@pytest.fixture(scope="session")
def te_backend(te_backend_name):
    """The backend under test, loaded through the registry (fails every test if it cannot load)."""
    from te_core import backend

    try:
        return backend.get_backend(te_backend_name)
    except backend.BackendError as exc:
        pytest.fail(f"--te-backend {te_backend_name}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def te_device(te_backend):
    """The backend's default device: every input of the kit goes there."""
    return te_backend.device


@pytest.fixture(scope="session")
def reference_impls():
    """op name -> the reference implementation (the oracle)."""
    from te_core.reference.plugin import implementations

    return implementations()


def pytest_report_header(config):
    if any("te_core.testing" in str(arg) or "test_conformance" in str(arg) for arg in config.args):
        return f"te-core conformance kit: --te-backend {config.getoption('--te-backend')}"
    return None


_OP_TEST = "test_op_matches_reference["


def _op_of(nodeid: str) -> str:
    return nodeid.split(_OP_TEST, 1)[1].split("[", 1)[0]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One paragraph per run of the kit: which ops are native, declined in part, or fall back."""
    outcomes = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if _OP_TEST not in nodeid:
                continue
            fallback = outcome == "skipped" and "fallback to reference" in str(report.longrepr)
            outcomes.setdefault(_op_of(nodeid), []).append("fallback" if fallback else outcome)
    if not outcomes:
        return
    fallback = sorted(op for op, seen in outcomes.items() if set(seen) == {"fallback"})
    failing = sorted(op for op, seen in outcomes.items() if {"failed", "error"} & set(seen))
    declined = sorted(op for op, seen in outcomes.items() if "skipped" in seen)
    native = sorted(set(outcomes) - set(fallback))
    write = terminalreporter.write_line
    terminalreporter.section(f"te-core conformance: backend {config.getoption('--te-backend')!r}")
    write(f"native ops ({len(native)}): {', '.join(native) or 'none'}")
    write(f"  failing ({len(failing)}): {', '.join(failing) or 'none'}")
    write(f"  with cases declined (capability check or supports()): {', '.join(declined) or 'none'}")
    write(f"fallback to reference, not declared ({len(fallback)}): {', '.join(fallback) or 'none'}")
