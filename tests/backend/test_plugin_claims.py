"""A plugin's info and capabilities are checked when loaded: a malformed or contradictory claim
marks the plugin broken with the reason, and neither selection nor `te-core info` trips over it."""
import pytest

from te_core import backend, info
from te_core.backend import BackendError, BackendInfo, Capabilities, hookimpl

from registry_fakes import FakeEntryPoint, make_plugin


def _info_hook(**fields):
    @hookimpl
    def te_backend_info():
        return BackendInfo(**{"name": "odd", "device_type": "meta", **fields})

    return te_backend_info


@pytest.mark.parametrize("fields, problem", [
    (dict(name=""), "name must be a non-empty string"),
    (dict(device_type=None), "device_type must be a non-empty string"),
    (dict(vendor_versions=["torch"]), "vendor_versions must be a mapping"),
    (dict(vendor_versions={"acmelib": 3}), "vendor_versions['acmelib'] must be a version string or None"),
])
def test_malformed_info_marks_the_plugin_broken(plugins, fields, problem):
    plugins([FakeEntryPoint("odd", make_plugin("odd", te_backend_info=_info_hook(**fields)))])
    (broken,) = backend.broken_plugins()
    assert "malformed BackendInfo" in broken.error and problem in broken.error
    report = info.collect()  # does not raise, and json-serialisable names only
    assert report["selected"] == "reference" and report["broken"][0]["name"] == "odd"


@pytest.mark.parametrize("caps, problem", [
    (Capabilities(fp8_formats={"E4M3": 240.0}), "gives E4M3 the max 240.0; te-core's E4M3 has max 448"),
    (Capabilities(fp8_formats={"E4M3FNUZ": 240.0}), "names 'E4M3FNUZ'"),
    (Capabilities(scaling_modes=frozenset({"tensorwise", "blockwise_4x4"})), "scaling_modes names ['blockwise_4x4']"),
    (Capabilities(scaling_modes=["tensorwise"]), "scaling_modes must be a frozenset"),
    (Capabilities(notes="block scaling missing"), "notes must be a tuple of strings"),
    (Capabilities(arch=90), "arch must be a string"),
])
def test_malformed_capabilities_mark_the_plugin_broken_and_auto_moves_on(plugins, caps, problem):
    plugins([FakeEntryPoint("odd", make_plugin("odd", caps=caps))])
    with pytest.warns(RuntimeWarning, match="'odd' is broken"):
        assert backend.get_backend().name == "reference"
    (broken,) = backend.broken_plugins()
    assert "malformed Capabilities" in broken.error and problem in broken.error
    with pytest.raises(BackendError, match="installed but broken.*malformed Capabilities"):
        backend.set_backend("odd")


def test_info_lists_a_plugin_with_malformed_capabilities_as_broken(plugins):
    plugins([FakeEntryPoint("odd", make_plugin("odd", caps=Capabilities(fp8_formats={"E5M2": float("nan")})))])
    report = info.collect()
    assert [b["name"] for b in report["backends"]] == ["reference"]
    assert "E5M2 the max nan" in report["broken"][0]["error"]
    assert "Broken plugins:" in info.render(report)
