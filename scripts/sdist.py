#!/usr/bin/env python3
"""The llama-cpp-python 0.3.36 source distribution: fetched once into the machine cache through pip
(so the user's index, proxy and certificate settings apply), checked by hash, unpacked. It carries llama.cpp (the test oracle), its gguf-py, tokenizer test vocabularies and
chat templates — none of which are ours, so none is committed.

usage: python scripts/sdist.py [root|gguf-py|wheel]   prints the path asked for (fetching/building it)

Stdout carries that one path and nothing else (callers read it); pip's own output goes to stderr.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def cache_dir() -> Path:
    d = Path(os.environ.get("QK_CACHE", Path.home() / ".cache" / "qk"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    """Runs pip with its output on stderr: stdout belongs to whoever reads this script's answer."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env, stdout=sys.stderr)


def tarball() -> Path:
    """The sdist archive, fetched by pip if absent or if its hash is wrong."""
    path = cache_dir() / f"llama_cpp_python-{VERSION}.tar.gz"
    if path.exists() and _sha256(path) == SHA256:
        return path
    part = cache_dir() / "download.part"
    part.mkdir(exist_ok=True)
    for old in part.iterdir():
        old.unlink()
    # Only this package from source: its build tools (cmake, ninja) may come as wheels.
    _pip(
        "download",
        "--no-deps",
        "--no-binary",
        "llama-cpp-python",
        "-d",
        str(part),
        f"llama-cpp-python=={VERSION}",
    )
    got_path = part / path.name
    got = _sha256(got_path)
    if got != SHA256:
        got_path.unlink()
        raise RuntimeError(f"llama-cpp-python sdist hash mismatch: got {got}, want {SHA256}")
    got_path.rename(path)
    return path


def root() -> Path:
    """The unpacked sdist (llama_cpp_python-0.3.36/)."""
    out = cache_dir() / "sdist"
    top = out / f"llama_cpp_python-{VERSION}"
    stamp = top / ".qk-unpacked"
    if stamp.exists():
        return top
    with tarfile.open(tarball()) as t:
        t.extractall(out, filter="data")
    stamp.write_text(SHA256)
    return top


def llama_cpp() -> Path:
    return root() / "vendor" / "llama.cpp"


def gguf_py() -> Path:
    """gguf-py from the sdist: it knows the qwen3next / qwen35moe architectures."""
    return llama_cpp() / "gguf-py"


def wheel() -> Path:
    """A llama-cpp-python wheel built from the sdist for this machine (CPU only), built once."""
    # The build's flags name the cache folder, so a wheel built with other flags is not reused.
    wheels = cache_dir() / "wheels" / "native-no-amx"
    found = sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    if found:
        return found[-1]
    wheels.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # CPU only, no BLAS, no server binaries: the oracle needs libllama and its quantizer.
    env["CMAKE_ARGS"] = "-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    if platform.machine().lower() in ("x86_64", "amd64"):
        # Tuned to this CPU except for AMX: a virtual machine can report AMX tiles whose first use
        # faults (SIGILL at tilezero in ggml's AMX mat-mul), and the oracle needs no speed.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = f"{env.get(var, '')} {no_amx}".strip()
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    _pip("wheel", "--no-deps", "-w", str(wheels), str(tarball()), env=env)
    return sorted(wheels.glob(f"llama_cpp_python-{VERSION}-*.whl"))[-1]


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "root"
    print({"root": root, "gguf-py": gguf_py, "llama.cpp": llama_cpp, "wheel": wheel}[what]())
