"""Tuning configs per device: the architecture's table at the device's SM count, read from the
device once, never at import time (torch.cuda faked on the CPU)."""
import dataclasses
import subprocess
import sys
import types

import pytest
import torch
from te_backend_cuda import configs
from te_triton import Config


def _all_configs(tuned):
    """(field name, Config) for every config of a Tuning, norm_tma's entries included."""
    for f in dataclasses.fields(tuned):
        value = getattr(tuned, f.name)
        if isinstance(value, Config):
            yield f.name, value
        else:
            for key, cfg in sorted(value.items()):
                yield f"{f.name}{key}", cfg


def test_sm90_keeps_the_tuned_table():
    """Hopper with 132 SMs (H100 SXM, H200): the configs the sweep chose; program caps are
    multiples of 132."""
    tuned = configs.tuning((9, 0), 132)
    assert tuned.quantize == Config(block=8192, num_warps=8, max_programs=528, hw_saturate=True)
    assert tuned.norm_tma[True, True] == Config(num_warps=16, max_programs=132, rows=2, hw_saturate=True,
                                                tma_stages=4)
    assert tuned.dbias_cast_transpose == Config(block_m=32, block_n=64, num_warps=8, max_programs=1056,
                                                hw_saturate=True, prefetch=True)
    assert tuned.norm_bwd == Config(num_warps=8, max_programs=264)
    assert tuned.loss == Config(block=4096, num_warps=8)


@pytest.mark.parametrize("sms", [1, 66, 114, 170])
def test_program_caps_follow_the_sm_count(sms):
    """A GPU with another SM count gets the same configs with caps per SM kept; caps of 0 (one
    program per work item) stay 0."""
    base = dict(_all_configs(configs.tuning((9, 0), 132)))
    for name, cfg in _all_configs(configs.tuning((9, 0), sms)):
        want = dataclasses.replace(base[name], max_programs=base[name].max_programs // 132 * sms)
        assert cfg == want, name


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_untuned_architectures_take_the_default(capability):
    assert capability not in configs.TUNED
    assert configs.tuning(capability, 100) == configs.DEFAULT(100)


def test_a_gpu_without_sms_is_refused():
    with pytest.raises(ValueError, match="at least one SM, got sms=0"):
        configs.tuning((9, 0), 0)


def test_each_device_is_read_once(monkeypatch):
    devices = {0: (9, 0, 132), 1: (8, 0, 108)}
    reads = []

    def properties(index):
        reads.append(index)
        major, minor, sms = devices[index]
        return types.SimpleNamespace(major=major, minor=minor, multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    configs.for_device.cache_clear()
    try:
        first = configs.for_device(0)
        assert configs.for_device(0) is first and first == configs.tuning((9, 0), 132)
        assert configs.for_device(1) == configs.tuning((8, 0), 108)
        assert reads == [0, 1]
    finally:
        configs.for_device.cache_clear()


def test_importing_the_backend_touches_no_gpu():
    """Every way into torch.cuda's device state fails in the child; importing the plugin, the
    configs and every op module must not reach one."""
    code = (
        "import torch\n"
        "def boom(*a, **k):\n"
        "    raise AssertionError('the GPU was touched at import time')\n"
        "for name in ('_lazy_init', 'get_device_properties', 'get_device_capability', 'current_device',\n"
        "             'device_count', 'get_device_name'):\n"
        "    setattr(torch.cuda, name, boom)\n"
        "import te_backend_cuda.plugin, te_backend_cuda.configs, te_backend_cuda.ops\n"
        "te_backend_cuda.plugin.te_backend_ops()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
