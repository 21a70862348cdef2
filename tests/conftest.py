"""Shared test set-up: paths, the llama-cpp-python sdist (oracle and test data), hypothesis profile,
and the GPU policy (QK_REQUIRE_GPU=1 turns a missing adapter into a failure instead of a skip)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))

# Lavapipe and the oracle are slow and their speed varies: no per-example deadline.
settings.register_profile(
    "qk", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("qk")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for servers and workers started by tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_gpu() -> bool:
    return os.environ.get("QK_REQUIRE_GPU") == "1"


@pytest.fixture(scope="session")
def sdist_root() -> Path:
    """The unpacked llama-cpp-python 0.3.36 sdist (fetched and hash-checked once per machine)."""
    import sdist

    return sdist.root()


@pytest.fixture(scope="session")
def llama_cpp_src(sdist_root: Path) -> Path:
    return sdist_root / "vendor" / "llama.cpp"


def make_engine(path, **kwargs):
    """The engine the parity gates compare with llama.cpp: qk's precise settings. Today's defaults are
    the precise ones (f32 mat-mat tiles, f32 KV cache); once the engine has a `precise` option, this
    is the one place that passes it. A missing adapter skips, or fails under QK_REQUIRE_GPU=1."""
    try:
        from qk import _qk
    except ImportError:
        if require_gpu():
            raise
        pytest.skip("qk._qk not built")
    try:
        return _qk.Engine(str(path), **kwargs)
    except _qk.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")
