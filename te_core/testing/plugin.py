"""pytest plugin of the conformance kit: the ``--te-backend`` option and its fixtures.

Loaded in every pytest session through te-core's ``pytest11`` entry point, so it imports
nothing heavy at load time: the registry is only touched when a kit fixture is used.

The backend under test is the one named by ``--te-backend``, else by ``TE_BACKEND`` (as a
vendor's own tests run with it set), else ``reference``; ``auto`` means the backend it selects
here. A vendor's tests that take the ``te_backend`` fixture thus never test the reference
against itself while the vendor's backend is named either way.
"""
from __future__ import annotations

import os
import sys
from typing import Tuple

import pytest

DEFAULT_BACKEND = "reference"


def pytest_addoption(parser):
    group = parser.getgroup("te-core", "te-core backend conformance kit")
    group.addoption(
        "--te-backend",
        action="store",
        default=None,
        metavar="NAME",
        help="backend the kit's fixtures test, e.g. with `pytest --pyargs te_core.testing` "
             f"(default: $TE_BACKEND, else {DEFAULT_BACKEND})",
    )


def requested_backend(config) -> Tuple[str, str]:
    """(name, where it came from) of the backend under test: --te-backend, else TE_BACKEND,
    else the reference."""
    given = config.getoption("--te-backend")
    if given:
        return given, f"--te-backend {given}"
    env = os.environ.get("TE_BACKEND", "").strip()
    if env:
        return env, f"TE_BACKEND={env}"
    return DEFAULT_BACKEND, f"{DEFAULT_BACKEND} (neither --te-backend nor TE_BACKEND given)"


@pytest.fixture(scope="session", autouse=True)
def _cpu_transcendentals_warmed():
    """Runs torch's CPU transcendentals once before the first test computes anything.

    In a few percent of processes, torch's CPU wheel (2.13, two intra-op threads) computes the
    process's first float32 tanh less accurately (about 4e-5 off): the reference's GELU, the
    oracle of the first test, then fails a correct backend by about 1e-4. Starting the thread
    pool alone (one large elementwise op) does not prevent it; running each transcendental once
    after it, on a tensor above and one below the intra-op grain size, does. Only where the
    tests have imported torch already, so that sessions without torch stay as light as they were.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.ones(1 << 20).add_(1.0)  # above torch's intra-op grain size: a parallel region
        for op in (torch.tanh, torch.erf, torch.exp, torch.sigmoid):
            op(torch.linspace(-4.0, 4.0, 1 << 20))
            op(torch.linspace(-4.0, 4.0, 4096))
    yield


@pytest.fixture(scope="session")
def te_backend_name(request) -> str:
    """The name of the backend under test (see requested_backend); for `auto`, the name of the
    backend auto selects here."""
    name, source = requested_backend(request.config)
    if name != "auto":
        return name
    from te_core import backend

    try:
        return backend.set_backend("auto").name
    except backend.BackendError as exc:
        pytest.fail(f"{source}: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def te_backend(request, te_backend_name):
    """The backend under test, loaded through the registry (fails every test if it cannot load)."""
    from te_core import backend

    try:
        return backend.get_backend(te_backend_name)
    except backend.BackendError as exc:
        pytest.fail(f"{requested_backend(request.config)[1]}: {exc}", pytrace=False)


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
        return f"te-core conformance kit: backend from {requested_backend(config)[1]}"
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
    terminalreporter.section(f"te-core conformance: backend {requested_backend(config)[0]!r}")
    write(f"native ops ({len(native)}): {', '.join(native) or 'none'}")
    write(f"  failing ({len(failing)}): {', '.join(failing) or 'none'}")
    write(f"  with cases declined (capability check or supports()): {', '.join(declined) or 'none'}")
    write(f"fallback to reference, not declared ({len(fallback)}): {', '.join(fallback) or 'none'}")
