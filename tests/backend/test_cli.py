"""The `te-core` command: --version, and configuration mistakes printed as one message (no
traceback, non-zero exit code)."""
import subprocess
import sys

import pytest
import torch

import te_core
from te_core import cli


def _te_core(*args, **env):
    return subprocess.run([sys.executable, "-m", "te_core", *args], capture_output=True, text=True,
                          env={"PATH": "", **env})


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    expected = f"te-core {te_core.__version__} (torch {torch.__version__}, python {sys.version.split()[0]})"
    assert capsys.readouterr().out.strip() == expected


def test_unknown_backend_is_one_message_without_traceback():
    out = _te_core("certify", "nosuch")
    assert out.returncode == 2
    assert out.stderr.startswith("te-core: error: unknown backend 'nosuch'. Installed backends:")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_bad_strict_value_in_info_is_reported_not_raised():
    out = _te_core("info", TE_BACKEND_STRICT="banana")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "TE_BACKEND_STRICT='banana' is not an on/off value" in out.stdout


def test_other_commands_refuse_extra_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["info", "--frobnicate"])
    assert done.value.code == 2 and "unrecognized arguments: --frobnicate" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["te_core", "te_core.demo"])
def test_a_reader_that_quits_early_is_no_error(module, tmp_path):
    # `te-core info | head -1`: the pipe closes while te-core still writes; that is the reader's
    # choice, not an unwritable path (the message for those) and not a traceback. The reader here
    # closes its end first, so that every run meets the closed pipe.
    args = ["info"] if module == "te_core" else ["--size", "tiny", "--steps", "2", "--no-progress", "--threads", "1",
                                                 "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "", "TE_BACKEND": "reference"}, cwd=tmp_path)
    proc.stdout.close()  # before anything is written: the first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == cli.EXIT_BROKEN_PIPE, err
    assert err == ""
