"""The install paths a new user takes, checked from outside the checkout: the oracle sdist helper's
stdout contract on a cold cache (a green CI with a warm cache once hid a broken first install), and the
built wheel alone in a fresh virtualenv running every entry point from a directory that is not the repo."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SDIST_SCRIPT = ROOT / "scripts" / "sdist.py"

# A stand-in for pip, found first on PYTHONPATH so `python -m pip` runs it: it prints build noise on
# stdout, as the real pip does, and makes the files the real one would (download: a copy of
# $FAKE_SDIST; wheel: an empty wheel named for this platform, and the C++ flags it was given).
FAKE_PIP = r"""
import os, shutil, sys
args = sys.argv[1:]
print("Looking in links: /somewhere\nProcessing something\nSuccessfully built llama_cpp_python")
def after(flag):
    return args[args.index(flag) + 1]
if args[0] == "download":
    shutil.copy(os.environ["FAKE_SDIST"], os.path.join(after("-d"), "llama_cpp_python-0.3.36.tar.gz"))
elif args[0] == "wheel":
    open(os.path.join(after("-w"), "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"), "wb").close()
    print("CXXFLAGS=" + os.environ.get("CXXFLAGS", ""))
else:
    sys.exit("fake pip: unexpected " + " ".join(args))
"""


def _real_sdist() -> Path | None:
    cache = Path(os.environ.get("QK_CACHE", Path.home() / ".cache" / "qk"))
    path = cache / "llama_cpp_python-0.3.36.tar.gz"
    return path if path.exists() else None


def _run_sdist(tmp_path: Path, what: str, sdist_bytes_from: Path) -> subprocess.CompletedProcess:
    fake = tmp_path / "fakepip" / "pip"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_PIP)
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path / "fakepip"),
        QK_CACHE=str(tmp_path / "cache"),
        FAKE_SDIST=str(sdist_bytes_from),
    )
    return subprocess.run(
        [sys.executable, str(SDIST_SCRIPT), what], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.timeout(300)
def test_sdist_wheel_prints_only_the_path_on_a_cold_cache(tmp_path):
    real = _real_sdist()
    if real is None:
        pytest.skip("the llama-cpp-python sdist is not in the machine cache (scripts/test.sh fetches it)")
    proc = _run_sdist(tmp_path, "wheel", real)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be the path alone, got {proc.stdout!r}"
    wheel = Path(lines[0])
    assert wheel.is_file() and wheel.parent == tmp_path / "cache" / "wheels" / "native-no-amx"
    assert "Successfully built" in proc.stderr  # pip's output went to stderr, not lost
    if platform.machine().lower() in ("x86_64", "amd64"):
        # llama.cpp's AMX kernels (SIGILL where a VM reports AMX it cannot run) stay out of the oracle.
        assert "-mno-amx-int8" in proc.stderr.split("CXXFLAGS=")[1].splitlines()[0]


def test_sdist_with_the_wrong_bytes_fails_and_keeps_nothing(tmp_path):
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not the sdist")
    proc = _run_sdist(tmp_path, "root", bad)
    assert proc.returncode != 0
    assert "hash mismatch" in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "cache" / "llama_cpp_python-0.3.36.tar.gz").exists()


def _wait_health(port: int, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"qk.serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("qk.serve never became healthy")


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_the_wheel_alone_serves_from_outside_the_checkout(tmp_path):
    from conftest import free_port

    # The dev profile is the one the test command already built: packaging it costs seconds.
    dist = tmp_path / "dist"
    subprocess.run(
        ["maturin", "build", "-q", "--profile", "dev", "-o", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("qk-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([py, *args], cwd=away, env=env, capture_output=True, text=True, timeout=300)

    for module in ("qk.worker", "qk.plan", "qk.serve", "qk.info"):
        out = run("-m", module, "--help")
        assert out.returncode == 0, (module, out.stderr)
        assert "usage" in out.stdout.lower()
    fixture = ROOT / "tests" / "fixtures" / "tiny-qwen3next-f32.gguf"
    shutil.copy(fixture, away / "m.gguf")
    code = (
        "import qk, sys; assert 'site-packages' in qk.__file__, qk.__file__\n"
        "e = qk.Engine('m.gguf', slots=1, ctx=64)\n"
        "print(len(e.generate([1, 2, 3], max_new=2)))"
    )
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
    port = free_port()
    server = subprocess.Popen(
        [py, "-m", "qk.serve", "--port", str(port)],
        cwd=away,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_health(port, server, 600)
        import httpx

        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/messages",
            json={"model": "qk", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] >= 1
    finally:
        server.terminate()
        server.wait(60)
