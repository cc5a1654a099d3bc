"""Transformer Engine's get_device_compute_capability / get_cudnn_version, answered by the
selected backend's Capabilities (compute_capability, library_versions)."""
import re

import pytest
import torch

import te_core
from te_core import backend
from te_core.backend import BackendError
from te_core.backend.types import Capabilities

from registry_fakes import FakeEntryPoint, make_plugin


def _random_version(n: int):
    return tuple(int(v) for v in torch.randint(0, 100, (n,)))


def _fake(caps):
    return FakeEntryPoint("fake", make_plugin("fake", caps=caps))


def test_a_backend_answers_with_its_device_and_libraries(plugins):
    capability, cudnn = _random_version(2), _random_version(3)
    plugins([_fake(Capabilities(arch="fake_1", compute_capability=capability,
                                library_versions={"cudnn": cudnn, "other": (1, 2, 3)}))])
    assert backend.get_backend().name == "fake"
    got = te_core.get_device_compute_capability()
    assert got == capability and type(got) is tuple and all(type(v) is int for v in got)
    assert te_core.get_cudnn_version() == cudnn


def test_the_answer_follows_the_selected_backend(plugins):
    plugins([_fake(Capabilities(compute_capability=(9, 0), library_versions={"cudnn": (9, 1, 0)}))])
    assert te_core.get_device_compute_capability() == (9, 0)
    backend.set_backend("reference")
    with pytest.raises(BackendError, match="the selected backend 'reference' runs on cpu, which has no compute "
                                           "capability"):
        te_core.get_device_compute_capability()
    backend.set_backend("fake")
    assert te_core.get_cudnn_version() == (9, 1, 0)


def test_reference_backend_says_there_is_nothing_to_answer(plugins):
    plugins([])
    assert backend.get_backend().name == "reference"
    with pytest.raises(BackendError) as err:
        te_core.get_device_compute_capability()
    assert "te.is_fp8_available()" in str(err.value) and "TE_BACKEND=<name>" in str(err.value)
    with pytest.raises(BackendError, match=re.escape("get_cudnn_version: the selected backend 'reference' (cpu) does "
                                                     "not run cuDNN, so there is no cuDNN version to give")):
        te_core.get_cudnn_version()


def test_a_backend_without_cudnn_names_the_libraries_it_runs(plugins):
    own = _random_version(3)
    plugins([_fake(Capabilities(compute_capability=(3, 1), library_versions={"acmednn": own}))])
    with pytest.raises(BackendError, match=re.escape(f"does not run cuDNN (it runs acmednn {'.'.join(map(str, own))})")):
        te_core.get_cudnn_version()
    assert te_core.get_device_compute_capability() == (3, 1)


@pytest.mark.parametrize("field, value, message", [
    ("compute_capability", (9,), "compute_capability must be a (major, minor) tuple of ints >= 0"),
    ("compute_capability", [9, 0], "compute_capability must be a (major, minor) tuple"),
    ("compute_capability", (9, -1), "compute_capability must be a (major, minor) tuple of ints >= 0"),
    ("compute_capability", (True, 0), "compute_capability must be a (major, minor) tuple"),
    ("library_versions", {"cudnn": 90100}, "library_versions['cudnn'] must be a (major, minor, patch) tuple"),
    ("library_versions", {"cudnn": (9, 1)}, "library_versions['cudnn'] must be a (major, minor, patch) tuple"),
    ("library_versions", [("cudnn", (9, 1, 0))], "library_versions must be a mapping"),
])
def test_malformed_answers_mark_the_backend_broken(plugins, field, value, message):
    plugins([_fake(Capabilities(**{field: value}))])
    with pytest.warns(RuntimeWarning, match="backend 'fake' is broken and is skipped"):
        assert backend.get_backend().name == "reference"
    broken = {b.name: b.error for b in backend.broken_plugins()}
    assert message in broken["fake"]


def test_stand_in_utils_module_has_te_names(plugins):
    """`from transformer_engine.pytorch.utils import ...` reaches the same functions."""
    import importlib.util
    import sys

    from te_core.compat.transformer_engine import uninstall_transformer_engine

    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    plugins([_fake(Capabilities(compute_capability=(10, 0), library_versions={"cudnn": (9, 8, 0)}))])
    uninstall_transformer_engine()
    te_core.install_as_transformer_engine()
    try:
        from transformer_engine.pytorch import get_cudnn_version as top
        from transformer_engine.pytorch.utils import get_cudnn_version, get_device_compute_capability, is_bf16_available

        assert top is get_cudnn_version is te_core.get_cudnn_version and is_bf16_available is te_core.is_bf16_available
        assert get_device_compute_capability() == (10, 0) and get_cudnn_version() == (9, 8, 0)
    finally:
        uninstall_transformer_engine()
