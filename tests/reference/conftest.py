"""Shared fixtures of the reference-backend tests: every test starts from a fixed seed."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
