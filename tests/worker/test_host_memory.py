"""retain_freed_memory: glibc's malloc thresholds raised on Linux, nothing done elsewhere."""

import sys

import pytest

from deepserve.worker.host_memory import retain_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_takes_effect_on_linux_glibc():
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert retain_freed_memory() is True
    assert retain_freed_memory(64 << 20) is True      # idempotent, any limit


def test_elsewhere_does_nothing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert retain_freed_memory() is False
