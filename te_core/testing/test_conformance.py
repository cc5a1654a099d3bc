"""The conformance kit: `pytest --pyargs te_core.testing --te-backend NAME` certifies a backend.

Every case of every contract op runs the backend's own implementation (OpImpl.fn, called
directly, not through dispatch) and compares it with the reference. Ops the backend does not
declare are skipped as fallbacks; cases its capability check or supports() declines are
skipped with the reason. Both are legitimate: the dispatcher runs the reference for them.
"""
from __future__ import annotations

import pytest
import torch

from te_core import backend as te_backend_api
from te_core.backend.types import API_VERSION, BackendInfo, Capabilities, OpImpl
from te_core.ops import CONTRACT
from te_core.testing.cases import CASES, cases_by_op
from te_core.testing.runner import decline_reason, run_case


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_reference(case, te_backend, te_device, reference_impls):
    impl = te_backend.ops.get(case.op)
    if impl is None:
        pytest.skip(f"fallback to reference: not declared by backend {te_backend.name!r} ({case.op})")
    reason = decline_reason(case, CONTRACT[case.op], impl, te_backend.capabilities, te_device)
    if reason is not None:
        pytest.skip(reason)
    run_case(case, impl.fn, reference_impls[case.op], te_device)


def test_cross_entropy_target_outside_the_vocabulary(te_backend, te_device):
    """The contract's one allowed difference: a class outside [0, V) raises ValueError (the
    reference) or makes that row's loss NaN, never a finite loss."""
    impl = te_backend.ops.get("cross_entropy")
    if impl is None:
        pytest.skip(f"fallback to reference: not declared by backend {te_backend.name!r} (cross_entropy)")
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 40, generator=gen).to(te_device)
    target = torch.randint(0, 40, (5,), generator=gen)
    target[1] = 40
    target = target.to(te_device)
    if impl.supports is not None and not impl.supports(logits, target, reduction="none")[0]:
        pytest.skip("declined by supports()")
    try:
        rows = impl.fn(logits, target, reduction="none")
    except ValueError as exc:
        assert "40" in str(exc), f"the error should name the bad class: {exc}"
        return
    rows = rows.cpu()
    assert torch.isnan(rows[1]), f"a target outside the vocabulary gave the finite loss {rows[1].item()}"
    assert not torch.isnan(rows[[0, 2, 3, 4]]).any()


@pytest.fixture
def te_selected(te_backend_name, monkeypatch):
    """The backend under test selected as a user would, without overrides or strict mode."""
    for var in ("TE_BACKEND_OVERRIDES", "TE_BACKEND_STRICT"):
        monkeypatch.delenv(var, raising=False)
    yield te_backend_api.set_backend(te_backend_name)
    monkeypatch.undo()
    te_backend_api.reset()


@pytest.mark.parametrize("case", [cases[0] for cases in cases_by_op().values()], ids=lambda c: c.id)
@pytest.mark.filterwarnings("ignore::te_core.backend.BackendFallbackWarning")
def test_dispatch_through_contract_op(case, te_selected, te_device, reference_impls):
    """te_core.ops.<op>(...) as users call it: the backend's result, or the reference's when
    it falls back, either way matching the reference."""
    run_case(case, CONTRACT[case.op], reference_impls[case.op], te_device)


@pytest.mark.parametrize("op", list(CONTRACT))
def test_kit_covers_op(op):
    assert cases_by_op().get(op), f"the kit has no case for contract op {op!r}; add one in te_core/testing/cases"


def test_declared_ops_are_contract_ops(te_backend):
    unknown = sorted(set(te_backend.ops) - set(CONTRACT))
    assert not unknown, f"backend declares ops outside the contract: {unknown}"
    for name, impl in te_backend.ops.items():
        assert isinstance(impl, OpImpl) and callable(impl.fn), f"{name}: expected an OpImpl with a callable fn"
        assert impl.supports is None or callable(impl.supports), f"{name}: supports must be callable or None"


def test_api_version_major_matches(te_backend):
    assert isinstance(te_backend.info, BackendInfo)
    ours, theirs = API_VERSION.split(".")[0], te_backend.info.api_version.split(".")[0]
    assert theirs == ours, f"backend speaks API {te_backend.info.api_version}, te-core {API_VERSION}"


def test_info_and_capabilities(te_backend, te_backend_name, te_device):
    assert te_backend.name == te_backend_name
    assert te_backend.available, te_backend.reason
    assert te_device.type == te_backend.device_type == te_backend.info.device_type
    caps = te_backend.capabilities
    assert isinstance(caps, Capabilities)
    assert caps.scaling_modes <= set(te_backend_api.types.SCALING_MODES), "unknown scaling modes declared"
    for name, fmax in caps.fp8_formats.items():
        assert name in ("E4M3", "E5M2") and fmax > 0, f"bad FP8 format entry {name!r}: {fmax!r}"


def test_device_module(te_backend, te_device):
    module = te_backend.device_module
    services = ("synchronize",) if te_device.type == "cpu" else ("synchronize", "current_device", "manual_seed")
    for service in services:
        assert callable(getattr(module, service, None)), f"device module lacks {service}()"
    torch.empty(4, device=te_device).fill_(1.0)
    module.synchronize()


def test_te_backend_env_selects_it(te_backend_name, monkeypatch):
    monkeypatch.setenv("TE_BACKEND", te_backend_name)
    for var in ("TE_BACKEND_OVERRIDES", "TE_BACKEND_STRICT"):
        monkeypatch.delenv(var, raising=False)
    try:
        te_backend_api.reset()  # forget the selection: the next use reads TE_BACKEND again
        assert te_backend_api.get_backend().name == te_backend_name
        assert "TE_BACKEND" in te_backend_api.selection_reason()
    finally:
        monkeypatch.undo()
        te_backend_api.reset()
