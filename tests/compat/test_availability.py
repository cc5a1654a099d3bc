"""The availability queries answer as Transformer Engine's: a bool, or (bool, reason) with
return_reason=True, so `if te.is_fp8_available():` means what it says."""
from __future__ import annotations

import pytest

import te_core as te

QUERIES = [te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available, te.is_bf16_available,
           te.is_nvfp4_available]


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: q.__name__)
def test_bool_by_default_and_reason_on_request(query):
    answer = query()
    assert type(answer) is bool
    ok, reason = query(return_reason=True)
    assert ok is answer and isinstance(reason, str)
    assert (reason == "") == ok  # a reason exactly when the answer is no


def test_fp8_available_on_reference_is_true():
    assert te.is_fp8_available() is True


def test_bf16_available_on_the_reference_backend_is_true():
    assert te.is_bf16_available() is True and te.is_bf16_available(return_reason=True) == (True, "")


def test_bf16_availability_asks_the_device_or_probes_it(monkeypatch):
    """On an accelerator: the device module's is_bf16_supported where it has one, else a bfloat16
    matmul on the device (here a fake backend whose device is the CPU, seen as an accelerator)."""
    from types import SimpleNamespace

    import torch

    import importlib

    from te_core import backend

    autocast_module = importlib.import_module("te_core.quantization.autocast")  # the module, not the class

    def fake(device_module):
        return SimpleNamespace(device_type="accel", device_module=device_module, name="fake",
                               device=torch.device("cpu"))

    for supported in (True, False):
        monkeypatch.setattr(backend, "get_backend", lambda: fake(SimpleNamespace(is_bf16_supported=lambda: supported)))
        ok, reason = autocast_module.is_bf16_available(return_reason=True)
        assert ok is supported and (reason == "") == supported and ("fake" in reason or supported)
    monkeypatch.setattr(backend, "get_backend", lambda: fake(SimpleNamespace()))  # no query: the probe runs
    assert autocast_module.is_bf16_available(return_reason=True) == (True, "")


def test_default_recipe_is_the_one_autocast_uses():
    from te_core.quantization import get_autocast_context

    assert isinstance(te.get_default_recipe(), te.recipe.DelayedScaling)
    with te.autocast():
        assert get_autocast_context().recipe is te.get_default_recipe()


def test_nvfp4_is_not_available_and_says_why():
    """TE's is_nvfp4_available(return_reason=False): te-core does not run NVFP4 on any backend."""
    import inspect

    assert te.is_nvfp4_available() is False
    ok, reason = te.is_nvfp4_available(return_reason=True)
    assert ok is False and "NVFP4 (FP4 E2M1 block scaling) is not supported by te-core" in reason
    assert "MXFP8BlockScaling" in reason
    assert list(inspect.signature(te.is_nvfp4_available).parameters) == ["return_reason"]
    assert inspect.signature(te.is_nvfp4_available).parameters["return_reason"].default is False
    assert te.quantization.is_nvfp4_available is te.is_nvfp4_available and "is_nvfp4_available" in te.__all__
