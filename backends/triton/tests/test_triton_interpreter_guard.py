"""This directory's conftest turns on Triton's interpreter for the whole pytest process: on a
machine with a GPU, a run that also collected GPU tests from elsewhere must stop with an error
that says why, not run their kernels through the interpreter."""
import importlib.util
import os
import types

import pytest
import torch

HERE = os.path.dirname(__file__)


def _guard():
    spec = importlib.util.spec_from_file_location("_triton_tests_conftest", os.path.join(HERE, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._refuse_gpu_tests_beside


def _item(*parts):
    path = os.path.join(*parts, "test_x.py")
    return types.SimpleNamespace(fspath=path, nodeid=f"{path}::test_x")


def test_a_gpu_machine_refuses_tests_from_elsewhere_in_the_same_run(monkeypatch):
    refuse = _guard()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    repo = os.path.dirname(os.path.dirname(HERE))
    with pytest.raises(pytest.UsageError, match="in a pytest process of its own"):
        refuse([_item(HERE), _item(repo, "cuda", "tests")], HERE)
    refuse([_item(HERE), _item(repo, "musa", "tests")], HERE)  # interpreted too: allowed


def test_without_a_gpu_everything_runs_together(monkeypatch):
    refuse = _guard()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refuse([_item(HERE), _item(os.path.dirname(HERE), "elsewhere")], HERE)
