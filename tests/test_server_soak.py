"""/health and running streams stay responsive while the server prepares maximal request bodies.

The server runs in its own process, as in production (a client in the same process would share its
GIL): uvicorn, the fake engine, the tiny tokenizer, a 32k context and the default bounds. Bodies at
those bounds are posted one after another — one message of text up to the body size, the most JSON
values allowed, a prompt that tokenises to far more than the context — while one client times
``GET /health`` every 10 ms and another reads a running SSE stream. Before request preparation moved
off the event loop, each such body stopped both for seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

CTX = 32768
#: The bound the issue sets: /health answers within this at the 99th percentile while bodies are
#: prepared, over and above what this machine's scheduling already costs without them (measured
#: first, below): on a shared CI box that baseline is not the server's doing.
HEALTH_P99_S = 0.100
#: Soak length: long enough for every body shape to be prepared several times.
SOAK_S = 8.0


def serve(port: int) -> None:
    """The child: a server around the fake engine (one token every 5 ms)."""
    import uvicorn
    from fake_engine import FakeEngine, make_app, tiny_tokenizer

    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=2, ctx=CTX, step_delay=0.005, banned=sorted(tok.eog_ids))
    app = make_app(engine, tok, slots=2, ctx=CTX)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def maximal_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) at the default bounds (8 MiB, 100,000 JSON values)."""
    from qk.server.validate import Limits

    limits = Limits()
    message = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    big = dict(
        message, messages=[{"role": "user", "content": "word, " * ((limits.max_body_bytes - 200) // 6)}]
    )
    # Each message is five values; the whole body stays just under the value bound.
    many = dict(message, messages=[{"role": "user", "content": "a"}] * ((limits.max_json_values - 50) // 5))
    # Passes the length check (at most 16 bytes a token) yet tokenises to ~20x the context.
    long_prompt = {"prompt": "x" * (CTX * 15), "n_predict": 1}
    bodies = [
        ("one 8 MiB message", "/v1/messages", json.dumps(big).encode()),
        ("100k JSON values", "/v1/chat/completions", json.dumps(many).encode()),
        ("prompt of 20x the context", "/completion", json.dumps(long_prompt).encode()),
    ]
    for name, _, body in bodies:
        assert len(body) <= limits.max_body_bytes, name
    return bodies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            out.append(time.perf_counter() - start)
            stop.wait(0.01)


@pytest.mark.timeout(180)
def test_health_and_streams_stay_fast_while_maximal_bodies_are_prepared():
    port = free_port()
    here = os.fspath(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_server_soak as t; t.serve({port})"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert child.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
            bodies = maximal_bodies()

            # What /health costs here with nothing else going on.
            stop, baseline = threading.Event(), []
            poller = threading.Thread(target=time_health, args=(url, stop, baseline))
            poller.start()
            time.sleep(1.5)
            stop.set()
            poller.join()

            # A stream runs through the soak: its gaps between events are timed too.
            gaps: list[float] = []

            def read_stream() -> None:
                with httpx.Client(base_url=url, timeout=60) as s:
                    body = {"prompt": "tell a story", "n_predict": 4000, "stream": True}
                    with s.stream("POST", "/completion", json=body) as r:
                        last = time.perf_counter()
                        for _ in r.iter_lines():
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now
                            if stop.is_set():
                                break

            stop, during = threading.Event(), []
            streamer = threading.Thread(target=read_stream)
            poller = threading.Thread(target=time_health, args=(url, stop, during))
            streamer.start()
            time.sleep(0.5)
            poller.start()
            answered: dict[str, list[int]] = {}
            end = time.monotonic() + SOAK_S
            while time.monotonic() < end:
                for name, path, body in bodies:
                    r = http.post(path, content=body, headers={"content-type": "application/json"})
                    answered.setdefault(name, []).append(r.status_code)
            stop.set()
            poller.join()
            streamer.join()
    finally:
        child.terminate()
        child.wait(20)

    # Each shape was prepared (and refused for the context, after all the work) at least twice.
    assert all(len(codes) >= 2 and set(codes) == {400} for codes in answered.values()), answered
    base_p99 = percentile(baseline, 0.99)
    p99 = percentile(during, 0.99)
    stream_p99 = percentile(gaps[20:], 0.99)
    report = f"/health p99 {p99 * 1e3:.1f} ms (baseline {base_p99 * 1e3:.1f} ms, {len(during)} probes); "
    report += f"stream gap p99 {stream_p99 * 1e3:.1f} ms over {len(gaps)} events"
    print(report)
    assert len(during) > 100 and len(gaps) > 200, report
    assert p99 <= HEALTH_P99_S + base_p99, report
    # A token every 5 ms: its events may not stall any longer than /health may.
    assert stream_p99 <= HEALTH_P99_S + base_p99, report
