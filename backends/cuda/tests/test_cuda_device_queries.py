"""te-backend-cuda's answers to TE's get_device_compute_capability / get_cudnn_version, with
torch.cuda and cuDNN mocked: the device's (major, minor) and cuDNN's decoded run-time version."""
import pytest
import torch
from te_backend_cuda import capabilities, plugin


@pytest.fixture
def fake_gpu(monkeypatch):
    cc = tuple(int(v) for v in torch.randint(5, 13, (1,))) + tuple(int(v) for v in torch.randint(0, 10, (1,)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA test GPU")
    capabilities.capabilities_for.cache_clear()
    yield cc
    capabilities.capabilities_for.cache_clear()


def _cudnn(monkeypatch, encoded):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: encoded is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: encoded)


@pytest.mark.parametrize("encoded, expected", [(90100, (9, 1, 0)), (91002, (9, 10, 2)), (8907, (8, 9, 7)),
                                               (8600, (8, 6, 0)), (100003, (10, 0, 3))])
def test_cudnn_versions_decode_both_encodings(encoded, expected):
    assert capabilities.decode_cudnn_version(encoded) == expected


def test_random_versions_round_trip():
    for major, minor, patch in torch.randint(0, 99, (20, 3)).tolist():
        major = 9 + major % 5
        assert capabilities.decode_cudnn_version(major * 10000 + minor * 100 + patch) == (major, minor, patch)
        assert capabilities.decode_cudnn_version(8000 + (minor % 10) * 100 + patch) == (8, minor % 10, patch)


def test_capabilities_carry_the_compute_capability_and_cudnn(fake_gpu, monkeypatch):
    _cudnn(monkeypatch, 90501)
    caps = capabilities.capabilities_for(0, lambda mode, device: (True, ""))
    assert caps.compute_capability == fake_gpu and caps.library_versions == {"cudnn": (9, 5, 1)}
    assert caps.arch == f"sm_{fake_gpu[0]}{fake_gpu[1]}" and not caps.problems()


def test_before_sm89_too(fake_gpu, monkeypatch):
    """The early return for GPUs without FP8 carries them as well."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    _cudnn(monkeypatch, 8907)
    caps = plugin.te_backend_capabilities(torch.device("cuda", 0))
    assert caps.fp8_formats == {} and caps.compute_capability == (7, 5)
    assert caps.library_versions == {"cudnn": (8, 9, 7)}


def test_no_cudnn_means_no_entry(fake_gpu, monkeypatch):
    _cudnn(monkeypatch, None)
    assert capabilities.capabilities_for(0, lambda mode, device: (True, "")).library_versions == {}
