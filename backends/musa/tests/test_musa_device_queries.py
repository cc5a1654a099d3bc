"""te-backend-musa's answer to TE's get_device_compute_capability (torch.musa's (major, minor)),
and no cuDNN version, on a faked torch_musa."""
from __future__ import annotations

import pytest
import torch

from te_backend_musa import plugin


@pytest.mark.parametrize("arch", [(2, 1), (2, 2), (3, 1)])
def test_compute_capability_is_the_musa_arch(fake_musa, arch):
    fake_musa(arch=arch)
    caps = plugin.te_backend_capabilities(torch.device("cpu"))
    assert caps.compute_capability == arch and caps.arch == f"mp_{arch[0]}{arch[1]}"
    assert caps.library_versions == {}  # no cuDNN on MUSA: get_cudnn_version raises
    assert not caps.problems()


def test_an_unlisted_arch_is_passed_through(fake_musa):
    arch = tuple(int(v) for v in torch.randint(4, 9, (2,)))
    fake_musa(arch=arch)
    assert plugin.te_backend_capabilities(torch.device("cpu")).compute_capability == arch
