"""Environment variables that configure selection: every value is understood or refused with the
accepted values (te_core.backend.settings), never silently read as something else."""
import re

import pytest

from te_core import backend
from te_core.backend import BackendError
from te_core.backend.sources import install_hints

from registry_fakes import FakeEntryPoint, make_plugin


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_strict_on_values(plugins, monkeypatch, value):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_STRICT", value)
    backend.set_backend("reference")
    assert backend.REGISTRY.selection().strict is True


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "off", "OFF", ""])
def test_strict_off_values(plugins, monkeypatch, value):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_STRICT", value)
    backend.set_backend("reference")
    assert backend.REGISTRY.selection().strict is False


@pytest.mark.parametrize("value", ["banana", "2", "enabled"])
def test_strict_other_values_are_refused_naming_the_accepted_ones(plugins, monkeypatch, value):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_STRICT", value)
    with pytest.raises(BackendError) as err:
        backend.get_backend()
    msg = str(err.value)
    assert f"TE_BACKEND_STRICT={value!r} is not an on/off value" in msg
    assert "1, true, yes, on" in msg and "'0', 'false', 'no', 'off', ''" in msg


def test_plugins_allowlist_typo_is_an_error_naming_installed(plugins, monkeypatch):
    plugins([FakeEntryPoint("cuda", make_plugin("cuda")), FakeEntryPoint("template", make_plugin("template", device_type="cpu"))])
    monkeypatch.setenv("TE_BACKEND_PLUGINS", "cdua")
    backend.reset()
    with pytest.raises(BackendError) as err:
        backend.get_backend()
    msg = str(err.value)
    assert "TE_BACKEND_PLUGINS='cdua' names 'cdua' (did you mean 'cuda'?), which is not an installed plugin" in msg
    assert "Installed plugins (entry-point names): cuda, template" in msg
    with pytest.raises(BackendError, match="TE_BACKEND_PLUGINS='cdua'"):
        backend.get_backend("reference")  # by name too: nothing runs on a half-understood setting


def test_plugins_allowlist_with_one_unknown_name_among_good_ones_is_an_error(plugins, monkeypatch):
    plugins([FakeEntryPoint("cuda", make_plugin("cuda")), FakeEntryPoint("template", make_plugin("template", device_type="cpu"))])
    monkeypatch.setenv("TE_BACKEND_PLUGINS", "cuda, tempalte")
    backend.reset()
    with pytest.raises(BackendError, match=re.escape("'tempalte' (did you mean 'template'?)")):
        backend.get_backend()


@pytest.mark.parametrize("value", ["", " , "])
def test_plugins_allowlist_naming_nothing_is_an_error(plugins, monkeypatch, value):
    plugins([FakeEntryPoint("cuda", make_plugin("cuda"))])
    monkeypatch.setenv("TE_BACKEND_PLUGINS", value)
    backend.reset()
    with pytest.raises(BackendError, match="names no plugin.*installed plugins: cuda.*TE_BACKEND=reference"):
        backend.get_backend()


def test_plugins_allowlist_accepts_reference_and_keeps_the_rest_out(plugins, monkeypatch):
    plugins([FakeEntryPoint("keep", make_plugin("keep")), FakeEntryPoint("drop", make_plugin("drop"))])
    monkeypatch.setenv("TE_BACKEND_PLUGINS", "reference,keep")
    backend.reset()
    assert sorted(b.name for b in backend.list_backends()) == ["keep", "reference"]
    assert backend.get_backend().name == "keep"


def test_overrides_unknown_backend_is_a_clear_error(plugins, monkeypatch):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "gemm=nope")
    with pytest.raises(BackendError, match=re.escape("TE_BACKEND_OVERRIDES entry 'gemm=nope': unknown backend 'nope'")):
        backend.get_backend()


def test_overrides_unknown_op_suggests_the_contract_op(plugins, monkeypatch):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "gemm_fp9=reference")
    with pytest.raises(BackendError, match=re.escape("names unknown op 'gemm_fp9' (did you mean 'gemm_fp8'?)")):
        backend.get_backend()


def test_overrides_malformed_entry(plugins, monkeypatch):
    plugins([])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "gemm:reference")
    with pytest.raises(BackendError, match="'gemm:reference' is not of the form op=backend"):
        backend.get_backend()


def test_overrides_op_the_backend_lacks_lists_what_it_has(plugins, monkeypatch):
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": lambda dy: dy.sum(0)}))])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "gemm=fake")
    with pytest.raises(BackendError, match="pins 'gemm' to backend 'fake', which does not implement it; it implements: dbias"):
        backend.get_backend()


def test_install_hints_come_from_the_source_tree(tmp_path, monkeypatch):
    (tmp_path / "backends" / "kernels").mkdir(parents=True)
    (tmp_path / "backends" / "kernels" / "pyproject.toml").write_text('[project]\nname = "acme-kernels"\n')
    (tmp_path / "backends" / "acme").mkdir()
    (tmp_path / "backends" / "acme" / "pyproject.toml").write_text(
        '[project]\nname = "te-backend-acme"\ndependencies = ["te-core", "acme-kernels>=1", "torch>=2.7"]\n\n'
        '[project.entry-points."te_core.backends"]\nacme = "te_backend_acme.plugin"\n\n[tool.other]\nx = "y"\n')
    monkeypatch.chdir(tmp_path)
    assert install_hints(tmp_path) == {"acme": "pip install ./backends/kernels ./backends/acme"}
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not below the current directory: absolute paths
    assert install_hints(tmp_path)["acme"] == f"pip install {tmp_path}/backends/kernels {tmp_path}/backends/acme"
