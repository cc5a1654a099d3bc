"""Fixtures shared by the cuda backend's tests."""
import pytest


@pytest.fixture
def sm90(monkeypatch):
    """The H100's tuning table (132 SMs) for every device index: what the twins read on a GPU."""
    from te_backend_cuda import configs

    tuning = configs.sm90(132)
    monkeypatch.setattr(configs, "for_device", lambda index: tuning)
    return tuning
