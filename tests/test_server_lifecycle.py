"""``python -m qk.serve`` as a process: SIGTERM drains (the in-flight stream completes, then the
process exits 0 and stops listening); the built-in demo model is written once into $QK_CACHE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

TESTS = Path(__file__).parent

SERVER_SCRIPT = """
import sys
from fake_engine import FakeEngine, tiny_tokenizer
from qk.driver import LocalDriver
from qk.server import Loaded
import qk.serve

tok = tiny_tokenizer()
engine = FakeEngine(tok.vocab_size, slots=1, step_delay=0.01, banned=sorted(tok.eog_ids))
sys.exit(qk.serve.main(sys.argv[1:], load=lambda: Loaded(LocalDriver(engine), tok, "fake", None)))
"""


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    with httpx.Client(timeout=2) as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.05)
    raise TimeoutError("server never became healthy")


def test_sigterm_finishes_in_flight_then_exits():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVER_SCRIPT,
            "--port",
            str(port),
            "--slots",
            "1",
            "--ctx",
            "4096",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_health(url, proc)
        chunks = []
        with httpx.Client(timeout=30) as c:
            with c.stream(
                "POST", url + "/completion", json={"prompt": "a", "n_predict": 60, "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 3:
                        proc.send_signal(signal.SIGTERM)
        # The request admitted before SIGTERM ran to its end: 60 tokens and a final chunk.
        assert chunks[-1]["stop"] is True and len(chunks[-1]["tokens"]) == 60
        # uvicorn re-raises the captured SIGTERM once shutdown is complete, so the process ends
        # "killed by SIGTERM" after a clean drain (0 on uvicorn versions that do not re-raise).
        assert proc.wait(30) in (0, -signal.SIGTERM)
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "Traceback" not in output, output
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def test_demo_model_written_once(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from qk import serve

    monkeypatch.setenv("QK_CACHE", str(tmp_path))
    path = serve.demo_model_path()
    assert path.parent == tmp_path / "demo" and path.exists()
    mtime = path.stat().st_mtime_ns
    assert serve.demo_model_path() == path and path.stat().st_mtime_ns == mtime
    assert not list(path.parent.glob("*.partial-*"))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    template = reader.fields["tokenizer.chat_template"]
    assert arch == serve.DEMO_ARCH
    assert "<|im_start|>" in bytes(template.parts[template.data[0]]).decode()


def test_cli_defaults():
    from qk import serve

    args = serve.parse_args([])
    assert args.ctx >= 32768 and args.host == "127.0.0.1" and args.port == 8080 and args.model is None


def test_cli_engine_flags_become_engine_keywords(capsys):
    """``--prefill-rows``, the cache types and ``--no-weight-arena`` go to the engine as keywords on
    the server and the worker alike; absent flags leave the engine's defaults; a piece that is not whole 64-position
    chunks is refused at the command line."""
    from qk import serve, worker

    args = serve.parse_args(["--prefill-rows", "512", "--cache-type-k", "q8_0"])
    assert worker.engine_args(args) == {"prefill_rows": 512, "cache_type_k": "q8_0"}
    assert worker.engine_args(serve.parse_args([])) == {}
    wargs = worker.build_parser().parse_args(
        ["--model", "m.gguf", "--layers", "2:4", "--prefill-rows", "128", "--no-weight-arena"]
    )
    assert worker.engine_args(wargs) == {"prefill_rows": 128, "weight_arena": False}
    assert serve.parse_args(["--no-weight-arena"]).no_weight_arena
    for bad in ("96", "0", "-64"):
        with pytest.raises(SystemExit):
            serve.parse_args(["--prefill-rows", bad])
        assert "multiple of 64" in capsys.readouterr().err


def test_missing_model_file_exits_2(tmp_path, capsys):
    from qk import serve

    assert serve.main(["--model", str(tmp_path / "nope.gguf")]) == 2
    assert "no such model file" in capsys.readouterr().err


@pytest.mark.gpu
def test_demo_serves_through_the_real_engine(tmp_path):
    pytest.importorskip("gguf")
    try:
        import qk.engine  # noqa: F401
    except ImportError:
        pytest.skip("the native engine is not in this build yet")
    import anthropic

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "QK_CACHE": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qk.serve", "--port", str(port), "--ctx", "1024", "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_health(url, proc, timeout=180)
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        m = client.messages.create(
            model="qk-demo", max_tokens=6, messages=[{"role": "user", "content": "Hi"}]
        )
        assert m.usage.output_tokens == 6 and m.stop_reason == "max_tokens"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "RANDOM" in output and "noise" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
