"""Split serving end to end (issue gates): ``python -m qk.serve --layers 0:A --split-next`` in front of
``python -m qk.worker`` processes on loopback, on the real engine (lavapipe in CI), against an unsplit
server on the same fixture. (1) split ≡ unsplit response bodies for 2 and 3 stages at several
boundaries; (2) streamed ≡ non-streamed through the split; (3) kill -9 of the worker mid-stream gives
the tokens already sent plus a clean error, the head stays up and serves again once the worker is
back; (4) two concurrent sequences each match the unsplit reference; (5) a mismatched worker is
refused at connect with its reason, shown on /health; (6) each process on the adapter its --device
names (in CI both lavapipe; where two adapter kinds are visible, head and worker on different ones)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from test_server_engine import live as _live_fixture  # noqa: F401 (a fixture)
from test_server_engine import native

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen3next-f32.gguf"
OTHER = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen35moe-f32.gguf"
N_LAYER = 4
SLOTS, CTX = 2, 512
#: Fields that differ between any two responses (ids, clocks, the seed drawn for an unseeded
#: request), removed before comparing bodies.
VOLATILE = frozenset({"id", "created", "created_at", "timings", "system_fingerprint", "seed"})


def normalise(body):
    if isinstance(body, dict):
        return {k: normalise(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [normalise(v) for v in body]
    return body


class Proc:
    """A qk process on loopback; its output is kept for the failure message."""

    def __init__(self, *args: str, prefix: tuple[str, ...] = ()) -> None:
        self.args = args
        env = {k: v for k, v in os.environ.items() if k != "QK_SECRET"}
        # A file, not a pipe: nobody reads while the test runs, and a full pipe would block the process.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", *args], env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def log_so_far(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def output(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def worker(
    layers: tuple[int, int], port: int, *extra: str, model: Path = FIXTURE, prefix: tuple[str, ...] = ()
) -> Proc:
    """``python -m qk.worker``; ``prefix`` runs it elsewhere (e.g. ``ip netns exec NS``)."""
    a, b = layers
    return Proc(
        "qk.worker", "--model", str(model), "--layers", f"{a}:{b}", "--port", str(port),
        "--slots", str(SLOTS), "--ctx", str(CTX), *extra, prefix=prefix,
    )  # fmt: skip


def head(end: int, next_port: int, port: int, *extra: str, next_host: str = "127.0.0.1") -> Proc:
    return Proc(
        "qk.serve", "--model", str(FIXTURE), "--layers", f"0:{end}", "--split-next", f"{next_host}:{next_port}",
        "--port", str(port), "--slots", str(SLOTS), "--ctx", str(CTX), "--log-level", "warning", *extra,
    )  # fmt: skip


def wait_health(url: str, procs: list[Proc], status: int = 200, timeout: float = 120.0) -> dict:
    end = time.monotonic() + timeout
    last = None
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < end:
            for p in procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.proc.returncode}:\n{p.output()}")
            try:
                r = c.get(url + "/health")
                last = r.json()
                if r.status_code == status:
                    return last
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"/health never answered {status}; last: {last}")


class Split:
    """Head + workers for the given cut points (e.g. [2] → 0:2 head, 2:4 worker)."""

    def __init__(self, cuts: list[int], *head_args: str, worker_args: tuple[str, ...] = ()) -> None:
        bounds = [0, *cuts, N_LAYER]
        self.ports = [free_port() for _ in cuts]
        self.workers: list[Proc] = []
        # Start-up order does not matter: workers come up last-first here, the head reconnects anyway.
        for i in reversed(range(len(cuts))):
            nxt = ["--next", f"127.0.0.1:{self.ports[i + 1]}"] if i + 1 < len(cuts) else []
            self.workers.insert(0, worker((bounds[i + 1], bounds[i + 2]), self.ports[i], *nxt, *worker_args))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.head = head(cuts[0], self.ports[0], self.port, *head_args)
        self.health = wait_health(self.url, [self.head, *self.workers])
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def close(self) -> None:
        self.http.close()
        for p in [self.head, *self.workers]:
            p.stop()


@pytest.fixture(scope="module")
def unsplit(_live_fixture):  # noqa: F811 (the imported fixture, by its registered name)
    """The unsplit reference: the whole model behind the same HTTP server, in this process."""
    return _live_fixture[0]


REQUESTS = [
    (
        "/v1/messages",
        {"model": "m", "max_tokens": 12, "messages": [{"role": "user", "content": "Hello there"}]},
    ),
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "max_tokens": 12,
            "temperature": 0.9,
            "seed": 5,
            "messages": [{"role": "user", "content": "Tell me a story about a small model"}],
        },
    ),
    ("/completion", {"prompt": "Once upon a time " * 20, "n_predict": 12}),
]


def sse_events(response: httpx.Response) -> list[tuple[str | None, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = line.split(":", 1)[1].strip()
            if data != "[DONE]":
                events.append((name, json.loads(data)))
            name = None
    return events


@pytest.mark.parametrize(
    "cuts,lanes,armed",
    [([1], 1, False), ([3], 2, False), ([1, 3], 2, False), ([2], 2, True)],
    ids=["2-stage@1", "2-stage@3-lanes2", "3-stage@1,3-lanes2", "2-stage@2-lanes2-armed"],
)
def test_split_equals_unsplit_streamed_and_concurrent(unsplit, cuts, lanes, armed):
    # Armed steps on every stage: streaks fire them, the concurrent pair and each new request retire them.
    flag = ("--armed-steps",) if armed else ()
    split = Split(cuts, "--lanes", str(lanes), *flag, worker_args=flag)
    try:
        stages = split.health["stages"]
        if armed:
            # Each engine says so as it loads (a Vulkan adapter: lavapipe in CI).
            assert all("armed steps" in p.log_so_far() for p in [split.head, *split.workers])
        assert [s["layers"] for s in stages] == [
            [a, b] for a, b in zip([0, *cuts], [*cuts, N_LAYER], strict=True)
        ]
        for route, body in REQUESTS:
            want = unsplit.http.post(route, json=body)
            got = split.http.post(route, json=body)
            assert got.status_code == want.status_code == 200, got.text
            assert normalise(got.json()) == normalise(want.json()), route
        # Streamed ≡ non-streamed through the split (Anthropic text deltas).
        route, body = REQUESTS[0]
        whole = split.http.post(route, json=body).json()
        with split.http.stream("POST", route, json={**body, "stream": True}) as r:
            deltas = [
                e["delta"]["text"]
                for name, e in sse_events(r)
                if name == "content_block_delta" and "text" in e["delta"]
            ]
        assert "".join(deltas) == "".join(b.get("text", "") for b in whole["content"])
        # Two concurrent sequences (one multi-slot step on every stage) each equal unsplit.
        prompts = ["The little model", "wanted to learn how to count to ten"]
        refs = [
            unsplit.http.post("/completion", json={"prompt": p, "n_predict": 16}).json()["tokens"]
            for p in prompts
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(
                pool.map(
                    lambda p: split.http.post("/completion", json={"prompt": p, "n_predict": 16}).json(),
                    prompts,
                )
            )
        assert [t["tokens"] for t in together] == refs
        metrics = split.http.get("/metrics").text
        assert f'qk_stage_up{{layers="0:{cuts[0]}",stage="head"}} 1.0' in metrics
    finally:
        split.close()


@pytest.mark.parametrize("armed", [False, True], ids=["plain", "armed"])
def test_kill_the_worker_mid_stream_then_restart(unsplit, armed):
    flag = ("--armed-steps",) if armed else ()
    split = Split([2], *flag, worker_args=flag)
    try:
        body = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True}
        contents, error = [], None
        with split.http.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line.split(":", 1)[1])
                if "error" in event:
                    error = event["error"]
                    break
                contents.append(event.get("content", ""))
                if len(contents) == 5:
                    split.workers[0].proc.send_signal(signal.SIGKILL)
                if event.get("stop"):
                    break
        assert error is not None, "the stream ended without an error after its worker died"
        assert 5 <= len(contents) < 400
        assert error["code"] == 503 and "stage" in error["message"].lower()
        # The head is up and says what is missing.
        down = wait_health(split.url, [split.head], status=503, timeout=30)
        assert down["chain"]["up"] is False
        # A request while the worker is down fails cleanly.
        r = split.http.post("/completion", json={"prompt": "Hi", "n_predict": 4})
        assert r.status_code == 503
        # The worker comes back on its port; the head reconnects by itself and serves again.
        split.workers[0].stop()
        split.workers[0] = worker((2, N_LAYER), split.ports[0], *flag)
        wait_health(split.url, [split.head, *split.workers], status=200, timeout=120)
        body = {"prompt": "Once upon a time", "n_predict": 12}
        want = unsplit.http.post("/completion", json=body).json()
        got = split.http.post("/completion", json=body).json()
        assert got["tokens"] == want["tokens"]
    finally:
        split.close()


def chain_error(url: str, procs: list[Proc], timeout: float = 60.0) -> dict:
    """/health once the head has loaded and tried the chain: 503 with the chain's last error."""
    deadline = time.monotonic() + timeout
    while True:
        down = wait_health(url, procs, status=503, timeout=timeout)
        if down.get("chain", {}).get("last_error") or time.monotonic() > deadline:
            return down
        time.sleep(0.2)


@pytest.mark.parametrize(
    "worker_args,reason",
    [
        (((3, N_LAYER),), "unserved"),
        (((1, N_LAYER),), "overlapping"),
        (((2, N_LAYER), "--slots", "1"), "slots"),
        (((2, N_LAYER), "--ctx", "128"), "ctx"),
        (((2, N_LAYER), "--secret", "not-the-heads"), "secret"),
    ],
    ids=["gap", "overlap", "slots", "ctx", "secret"],
)
def test_a_mismatched_worker_is_refused_with_its_reason(worker_args, reason):
    native()
    layers, *extra = worker_args
    port, head_port = free_port(), free_port()
    w = worker(layers, port, *extra)
    h = head(2, port, head_port)
    try:
        # The worker may still be starting at the head's first try ("connection refused"): wait for
        # the refusal that names the mismatch.
        url = f"http://127.0.0.1:{head_port}"
        deadline = time.monotonic() + 60
        down = chain_error(url, [h, w])
        while reason not in (down["chain"]["last_error"] or "").lower() and time.monotonic() < deadline:
            time.sleep(0.2)
            down = chain_error(url, [h, w])
        assert reason in (down["chain"]["last_error"] or "").lower(), down
        assert down["error"]["code"] == 503 and reason in down["error"]["message"].lower()
    finally:
        h.stop()
        w.stop()


def test_a_worker_of_another_model_is_refused():
    native()
    port, head_port = free_port(), free_port()
    w = worker((2, N_LAYER), port, model=OTHER)
    h = head(2, port, head_port)
    try:
        url = f"http://127.0.0.1:{head_port}"
        deadline = time.monotonic() + 60
        down = chain_error(url, [h, w])
        while "fingerprint" not in (down["chain"]["last_error"] or "") and time.monotonic() < deadline:
            time.sleep(0.2)
            down = chain_error(url, [h, w])
        assert "fingerprint" in down["chain"]["last_error"], down
    finally:
        h.stop()
        w.stop()


def test_each_stage_runs_on_the_adapter_its_device_names(unsplit):
    # The head picks its adapter by index, the worker by name: the first and the last adapter
    # listed, one adapter twice in CI (lavapipe), two kinds where a GPU and lavapipe are both there.
    _qk = native()
    adapters = _qk.adapters()
    head_adapter, worker_adapter = adapters[0], adapters[-1]
    split = Split(
        [2], "--device", str(head_adapter["index"]), worker_args=("--device", worker_adapter["name"])
    )
    try:
        stages = split.health["stages"]
        assert [s["adapter"] for s in stages] == [head_adapter["name"], worker_adapter["name"]]
        body = {"prompt": "Once upon a time " * 20, "n_predict": 12}
        got = split.http.post("/completion", json=body)
        assert got.status_code == 200, got.text
        if head_adapter["name"] == worker_adapter["name"] == _qk.selected_adapter()["name"]:
            # One adapter kind: byte for byte what the unsplit server answers.
            want = unsplit.http.post("/completion", json=body).json()
            assert normalise(got.json()) == normalise(want)
        else:
            # Two kinds round differently: equal tokens up to near-ties, which
            # benches/split_bench.py --worker-device certifies; here the chain must serve.
            assert len(got.json()["tokens"]) == 12
    finally:
        split.close()


def test_an_armed_whole_model_server_equals_the_plain_one(unsplit):
    """``qk.serve --armed-steps`` without a split: sampled requests' host-fed steps are armed, greedy
    ones chain (retiring what is armed first), concurrent requests change the batch; every body
    equals the plain server's."""
    port = free_port()
    server = Proc(
        "qk.serve", "--model", str(FIXTURE), "--port", str(port), "--slots", str(SLOTS), "--ctx", str(CTX),
        "--log-level", "warning", "--armed-steps",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, [server])
        assert "armed steps" in server.log_so_far()
        with httpx.Client(base_url=url, timeout=120) as http:
            for route, body in REQUESTS:
                want = unsplit.http.post(route, json=body)
                got = http.post(route, json=body)
                assert got.status_code == want.status_code == 200, got.text
                assert normalise(got.json()) == normalise(want.json()), route
            bodies = [
                {"prompt": "The little model", "n_predict": 16, "temperature": 0.8, "seed": 3},
                {"prompt": "wanted to learn how to count to ten", "n_predict": 16},
            ]
            refs = [unsplit.http.post("/completion", json=b).json()["tokens"] for b in bodies]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                together = list(pool.map(lambda b: http.post("/completion", json=b).json(), bodies))
            assert [t["tokens"] for t in together] == refs
    finally:
        server.stop()
