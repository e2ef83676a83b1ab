"""deepserve/envs.py: one declaration per DEEPSERVE_* variable, typed values, warnings for unknown names."""

from __future__ import annotations

import ast
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepserve import envs

PACKAGE_ROOT = Path(envs.__file__).parent


def test_defaults_when_unset(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert envs.DEEPSERVE_PDL is True
    assert envs.DEEPSERVE_GEMV_PREFETCH == 1
    assert envs.DEEPSERVE_API_KEY == []
    assert envs.DEEPSERVE_CACHE_DIR == Path.home() / ".cache" / "deepserve" / "kernels"


def test_values_are_parsed_on_each_access(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    assert envs.DEEPSERVE_CPU_KERNELS is False
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "on")
    assert envs.DEEPSERVE_CPU_KERNELS is True
    monkeypatch.setenv("DEEPSERVE_GEMV_PREFETCH", " 3 ")
    assert envs.get("DEEPSERVE_GEMV_PREFETCH") == 3
    monkeypatch.setenv("DEEPSERVE_API_KEY", "k1, k2,,")
    assert envs.DEEPSERVE_API_KEY == ["k1", "k2"]
    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", "/tmp/somewhere")
    assert envs.DEEPSERVE_CACHE_DIR == Path("/tmp/somewhere")
    monkeypatch.setenv("DEEPSERVE_PDL", "")          # empty is unset
    assert envs.DEEPSERVE_PDL is True


@pytest.mark.parametrize("name, raw, words", [
    ("DEEPSERVE_PDL", "flase", "DEEPSERVE_PDL='flase'"),
    ("DEEPSERVE_GEMV_PREFETCH", "two", "expected an integer"),
    ("DEEPSERVE_GEMV_PREFETCH", "7", "expected one of 0, 1, 2, 3"),
])
def test_bad_values_name_the_variable(monkeypatch, name, raw, words):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(words)):
        envs.get(name)


def test_undeclared_names_are_refused():
    with pytest.raises(KeyError, match="DEEPSERVE_NOPE"):
        envs.get("DEEPSERVE_NOPE")
    with pytest.raises(AttributeError):
        envs.DEEPSERVE_NOPE  # noqa: B018


def test_unknown_variables_warn_with_the_closest_name(caplog):
    environ = {"DEEPSERVE_FUSED_NORM": "0", "DEEPSERVE_ZZZZZZZZZZ": "1", "DEEPSERVE_PDL": "1", "PATH": "/bin"}
    assert envs.unknown_variables(environ) == [("DEEPSERVE_FUSED_NORM", "DEEPSERVE_FUSED_NORMS"),
                                               ("DEEPSERVE_ZZZZZZZZZZ", None)]
    with caplog.at_level(logging.WARNING, logger="deepserve.envs"):
        messages = envs.warn_unknown_variables(environ)
        again = envs.warn_unknown_variables(environ)      # once per process
    assert len(messages) == 2 and again == []
    assert "did you mean DEEPSERVE_FUSED_NORMS?" in messages[0]
    assert "DEEPSERVE_FUSED_NORM " in caplog.text


def test_describe_lists_every_variable_and_hides_secrets(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_API_KEY", "sk-secret")
    monkeypatch.setenv("DEEPSERVE_PDL", "banana")
    text = envs.describe()
    for name in envs.VARIABLES:
        assert name in text
    assert "sk-secret" not in text and "DEEPSERVE_API_KEY=***" in text
    assert "DEEPSERVE_PDL=<invalid" in text


def test_deepserve_env_command_prints_them():
    out = subprocess.run([sys.executable, "-m", "deepserve.cli", "env"], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "DEEPSERVE_EARLY_INPUT": "0"})
    assert out.returncode == 0, out.stderr
    assert "DEEPSERVE_GEMV_PREFETCH=1" in out.stdout
    assert "did you mean DEEPSERVE_EARLY_INPUTS?" in out.stderr


def _package_sources():
    return [p for p in sorted(PACKAGE_ROOT.rglob("*.py")) if p.name != "envs.py"]


def test_no_module_but_envs_reads_a_deepserve_variable_from_the_environment():
    offenders = []
    for path in _package_sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            # os.environ.get("DEEPSERVE_..."), os.environ["DEEPSERVE_..."], os.getenv("DEEPSERVE_...")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DEEPSERVE_"):
                offenders.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{node.lineno} {node.value}")
    assert not offenders, "read DEEPSERVE_* variables through deepserve.envs:\n" + "\n".join(offenders)


def test_every_variable_the_package_mentions_is_declared():
    mentioned = set()
    for path in _package_sources():
        mentioned |= set(re.findall(r"\bDEEPSERVE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert mentioned - set(envs.VARIABLES) == set()
