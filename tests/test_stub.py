"""The type stub python/qk/_qk.pyi says what the built native module really has: mypy's stubtest
imports qk._qk and compares every name, signature and class against the stub."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("qk._qk")
pytest.importorskip("mypy")


@pytest.mark.timeout(300)
def test_the_native_module_matches_its_stub():
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "qk._qk", "--mypy-config-file", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
