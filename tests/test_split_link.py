"""qk._qk.HeadLink against qk._qk.Worker serving Python test-double stages over loopback: a chain of
workers gives what the same stages give composed in-process; SAVE/LOAD go through the chain; a
stage's exception reaches the head with its name; a stopped stage fails calls and a restarted one is
reconnected to; hellos are refused with their reason; ``python -m qk.worker`` refuses an open port.
On a GPU: real engine stages over the link equal the unsplit engine, and the worker command serves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

_qk = pytest.importorskip("qk._qk")
from qk import TransportError  # noqa: E402

N_LAYER = 6
N_EMBD = 4
VOCAB = 1000


class DoubleStage:
    """Layers [first, end) of a made-up model: each row goes through every layer, mixed with the
    running sum of all rows its slot saw, so positions, resets and snapshots all change the output."""

    def __init__(self, first: int, end: int, **overrides: object) -> None:
        self.info = {
            "layer_first": first,
            "layer_end": end,
            "n_layer": N_LAYER,
            "n_embd": N_EMBD,
            "slots": 4,
            "ctx": 256,
            "snap_entries": 4,
            "snap_bytes": 1 << 20,
            "fingerprint": "python-test-double",
            "adapter": "numpy",
        }
        self.info.update(overrides)
        self.slots: dict[int, tuple[int, np.ndarray]] = {}
        self.snapshots: dict[int, tuple[int, np.ndarray]] = {}
        self.fail_next: str | None = None
        self.delay = 0.0

    def describe(self) -> dict:
        return dict(self.info)

    def desc(self, name: str) -> dict:
        return {"name": name, "boot_id": 1, **self.info}

    @property
    def last(self) -> bool:
        return self.info["layer_end"] == self.info["n_layer"]

    def _rows(self, tokens, hidden) -> np.ndarray:
        if tokens is not None:
            assert self.info["layer_first"] == 0, "token ids reach only the embedding stage"
            ids = np.asarray(tokens, dtype=np.float32)[:, None]
            return ids + np.arange(N_EMBD, dtype=np.float32) * np.float32(0.5)
        return np.array(hidden, dtype=np.float32)

    def _advance(self, slot: int, base: int, rows: np.ndarray) -> np.ndarray:
        time.sleep(self.delay)
        if self.fail_next is not None:
            message, self.fail_next = self.fail_next, None
            raise ValueError(message)
        if base == 0:
            self.slots[slot] = (0, np.zeros(N_EMBD, dtype=np.float32))
        if slot not in self.slots:
            raise ValueError(f"slot {slot} was never started")
        pos, acc = self.slots[slot]
        if pos != base:
            raise ValueError(f"base {base}, but slot {slot} is at {pos}")
        out = []
        for row in rows:
            row = row.copy()
            for layer in range(self.info["layer_first"], self.info["layer_end"]):
                acc = acc + row
                row = row * np.float32(0.5) + np.float32(layer) + acc * np.float32(0.25)
            out.append(row)
        self.slots[slot] = (pos + len(rows), acc)
        return np.stack(out).astype(np.float32)

    @staticmethod
    def _id(row: np.ndarray) -> int:
        h = 0x811C9DC5
        for bits in row.astype(np.float32).view(np.uint32):
            h = ((h ^ int(bits)) * 0x01000193) & 0xFFFFFFFF
        return h % VOCAB

    @staticmethod
    def _topk(row: np.ndarray, k: int) -> list[tuple[int, float]]:
        first = DoubleStage._id(row)
        return [((first + i) % VOCAB, float(row[i % N_EMBD] - i)) for i in range(k)]

    def run(self, slot, base, tokens, hidden, topk):
        out = self._advance(slot, base, self._rows(tokens, hidden))
        if not self.last:
            return out
        return [self._id(r) for r in out], self._topk(out[-1], topk)

    def step(self, entries, tokens, hidden, topk):
        rows = self._rows(tokens, hidden)
        out = np.concatenate([self._advance(s, b, rows[i : i + 1]) for i, (s, b) in enumerate(entries)])
        if not self.last:
            return out
        return [self._id(r) for r in out], [self._topk(r, topk) for r in out]

    def position(self, slot):
        return self.slots.get(slot, (0, None))[0]

    def save(self, slot, idx):
        self.snapshots[idx] = self.slots[slot]

    def load(self, slot, idx):
        if idx not in self.snapshots:
            raise KeyError(f"no snapshot {idx}")
        self.slots[slot] = self.snapshots[idx]

    def drop(self, idx):
        self.snapshots.pop(idx, None)

    def reset(self):
        self.slots.clear()
        self.snapshots.clear()


class Serving:
    """A Worker serving one stage on a thread, stopped by ``stop()``."""

    def __init__(self, stage: DoubleStage, name: str, next: str | None = None, port: int = 0, **kw) -> None:
        self.stage = stage
        self.worker = _qk.Worker(
            stage, port=port, name=name, next=next, connect_timeout=2.0, hello_timeout=5.0, **kw
        )
        self.addr = f"127.0.0.1:{self.worker.port}"
        self.thread = threading.Thread(target=self.worker.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


def link_to(addr: str, own: DoubleStage, **kw) -> _qk.HeadLink:
    return _qk.HeadLink(
        addr, own.desc("head"), connect_timeout=2.0, hello_timeout=5.0, backoff_min=0.01, **kw
    )


@pytest.fixture
def chain3():
    """Head [0, 2) in-process, workers w1 [2, 4) and w2 [4, 6)."""
    w2 = Serving(DoubleStage(4, N_LAYER), "w2")
    w1 = Serving(DoubleStage(2, 4), "w1", next=w2.addr)
    yield w1, w2
    for w in (w1, w2):
        w.stop()


def test_chain_equals_composition(chain3):
    w1, _ = chain3
    own = DoubleStage(0, 2)
    reference = [DoubleStage(0, 2), DoubleStage(2, 4), DoubleStage(4, N_LAYER)]
    link = link_to(w1.addr, own)
    assert [s["name"] for s in link.connect()] == ["w1", "w2"]

    def composed_run(slot, base, tokens, topk):
        out = reference[0].run(slot, base, tokens, None, 0)
        out = reference[1].run(slot, base, None, out, 0)
        return reference[2].run(slot, base, None, out, topk)

    for slot, prompt in enumerate([[11, 12, 13, 14], [7, 8]]):
        hidden = own.run(slot, 0, prompt, None, 0)
        ids, topk = link.run(slot, 0, hidden=hidden, topk=3)
        want_ids, want_topk = composed_run(slot, 0, prompt, 3)
        assert ids == want_ids
        assert [i for i, _ in topk] == [i for i, _ in want_topk]
        # Logits cross the wire as f32, exactly the test double's own f32 values.
        assert np.array_equal(np.float32([x for _, x in topk]), np.float32([x for _, x in want_topk]))

    entries = [(0, 4), (1, 2)]
    hidden = own.step(entries, [5, 6], None, 0)
    ids, topk = link.step(entries, hidden=hidden, topk=2)
    out = reference[0].step(entries, [5, 6], None, 0)
    out = reference[1].step(entries, None, out, 0)
    want_ids, want_topk = reference[2].step(entries, None, out, 2)
    assert ids == want_ids
    assert [[i for i, _ in t] for t in topk] == [[i for i, _ in t] for t in want_topk]
    assert 0 < link.ping() < 5
    link.close()


def test_save_load_and_stage_errors(chain3):
    w1, w2 = chain3
    own = DoubleStage(0, 2)
    link = link_to(w1.addr, own)
    link.run(0, 0, hidden=own.run(0, 0, [1, 2, 3], None, 0))
    saved = own.slots[0]
    link.save(0, 1)
    cont = own.run(0, 3, [4], None, 0)
    first = link.run(0, 3, hidden=cont, topk=2)
    link.run(0, 4, hidden=own.run(0, 4, [99], None, 0))
    own.slots[0] = saved
    link.load(0, 1)
    assert link.run(0, 3, hidden=cont, topk=2) == first

    with pytest.raises(TransportError, match=r"stage 'w1'.*no snapshot 3"):
        link.load(0, 3)
    w2.stage.fail_next = "the GPU caught fire"
    with pytest.raises(TransportError, match=r"stage 'w2'.*ValueError: the GPU caught fire"):
        link.run(1, 0, hidden=DoubleStage(0, 2).run(1, 0, [1], None, 0))
    assert link.is_up
    with pytest.raises(ValueError, match="exactly one of"):
        link.run(0, 0)
    link.close()


@pytest.mark.timeout(30)
def test_reading_the_link_during_a_call_does_not_hold_the_gil(chain3):
    # The call in flight holds the link; a getter waiting for it must not hold the GIL, which the
    # Python stages of the workers in this process need to finish that very call.
    w1, w2 = chain3
    own = DoubleStage(0, 2)
    link = link_to(w1.addr, own)
    link.connect()
    w2.stage.delay = 0.3
    hidden = own.run(0, 0, [1, 2], None, 0)
    results = []
    call = threading.Thread(target=lambda: results.append(link.run(0, 0, hidden=hidden)))
    call.start()
    time.sleep(0.05)
    assert link.sessions == 1 and link.is_up
    call.join(20)
    assert len(results) == 1
    link.close()


def test_a_restarted_stage_is_reconnected_to(chain3):
    w1, w2 = chain3
    own = DoubleStage(0, 2)
    link = link_to(w1.addr, own)
    hidden = own.run(0, 0, [1, 2], None, 0)
    before = link.run(0, 0, hidden=hidden)
    port = int(w2.addr.rsplit(":", 1)[1])
    w2.stop()
    with pytest.raises(TransportError, match="downstream unavailable"):
        link.run(0, 0, hidden=hidden)
    assert not link.is_up and link.last_error
    restarted = Serving(DoubleStage(4, N_LAYER), "w2", port=port)
    try:
        assert link.run(0, 0, hidden=hidden) == before
        assert link.take_restarted() == ["w2"]
        assert link.sessions == 2
    finally:
        link.close()
        restarted.stop()


def test_hello_refusals_name_the_problem():
    own = DoubleStage(0, 2)
    wrong = Serving(DoubleStage(2, N_LAYER, fingerprint="another-model"), "w1")
    try:
        with pytest.raises(TransportError, match="chain refused.*fingerprint another-model"):
            link_to(wrong.addr, own).connect()
    finally:
        wrong.stop()
    locked = Serving(DoubleStage(2, N_LAYER), "w1", secret="s3cret")
    try:
        with pytest.raises(TransportError, match="authentication failed"):
            link_to(locked.addr, own, secret=b"guess").connect()
        link = link_to(locked.addr, own, secret="s3cret")
        assert link.connect()[0]["name"] == "w1"
        link.close()
    finally:
        locked.stop()


def test_a_stage_without_the_methods_is_refused():
    with pytest.raises(TypeError, match="describe"):
        _qk.Worker(object())


def run_worker_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QK_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "qk.worker", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_worker_cli_refuses_an_open_port_without_a_secret():
    result = run_worker_cli("--model", "m.gguf", "--layers", "2:4", "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "without a shared secret" in result.stderr and "--insecure" in result.stderr
    bad = run_worker_cli("--model", "m.gguf", "--layers", "4:2")
    assert bad.returncode == 2 and "empty" in bad.stderr


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen3next-f32.gguf"


@pytest.mark.gpu
def test_engine_stages_over_the_link_equal_the_unsplit_engine():
    # Split ≡ unsplit is byte-exact by design (docs/numerics.md "Determinism": fixed reduction order,
    # 64-aligned chunking at absolute positions), so ids, top-k ids and logits are compared exactly.
    from conftest import require_gpu
    from qk._qk import EngineStage
    from qk.gguf import Gguf

    if not hasattr(_qk, "Engine"):
        pytest.skip("this build has no qk.Engine")
    try:
        whole = _qk.Engine(str(FIXTURE), slots=1, ctx=256)
    except _qk.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")
    n_layer = whole.info()["n_layer"]
    cut = n_layer // 2
    fingerprint = Gguf(str(FIXTURE), header_only=True).fingerprint
    head_engine = _qk.Engine(str(FIXTURE), layers=(0, cut), slots=1, ctx=256)
    tail = EngineStage(_qk.Engine(str(FIXTURE), layers=(cut, n_layer), slots=1, ctx=256), fingerprint, 4)
    own = {"name": "head", "boot_id": 1, **EngineStage(head_engine, fingerprint, 4).describe()}
    worker = Serving(tail, "tail")
    try:
        link = _qk.HeadLink(worker.addr, own, connect_timeout=2.0, hello_timeout=30.0)
        prompt = [3, 14, 15, 92, 65, 35, 89, 79]
        want_ids, want_top = whole.stage_run(0, prompt, 0, 4)
        ids, top = link.run(0, 0, hidden=head_engine.stage_run(0, prompt, 0), topk=4)
        assert ids == list(want_ids)
        assert top == [(i, x) for i, x in want_top]
        link.save(0, 1)
        nxt = ids[-1]
        [(want_step_ids, want_step_top)] = whole.step([0], [nxt], 2)
        hidden = np.concatenate(head_engine.step([0], [nxt]))
        step_ids, step_top = link.step([(0, len(prompt))], hidden=hidden, topk=2)
        assert step_ids == list(want_step_ids)
        assert step_top == [[(i, x) for i, x in want_step_top]]
        link.close()
    finally:
        worker.stop()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_the_worker_command_serves_a_head():
    from conftest import free_port, require_gpu
    from qk._qk import EngineStage
    from qk.gguf import Gguf

    if not hasattr(_qk, "Engine"):
        pytest.skip("this build has no qk.Engine")
    try:
        head_engine = _qk.Engine(str(FIXTURE), layers=(0, 1), slots=1, ctx=256)
    except _qk.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")
    n_layer = head_engine.info()["n_layer"]
    whole = _qk.Engine(str(FIXTURE), slots=1, ctx=256)
    fingerprint = Gguf(str(FIXTURE), header_only=True).fingerprint
    own = {"name": "head", "boot_id": 1, **EngineStage(head_engine, fingerprint, 4).describe()}
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "QK_SECRET"}
    args = ["--model", str(FIXTURE), "--layers", f"1:{n_layer}", "--port", str(port), "--slots", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qk.worker", *args, "--ctx", "256"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        link = _qk.HeadLink(f"127.0.0.1:{port}", own, connect_timeout=1.0, hello_timeout=30.0)
        deadline = time.monotonic() + 60
        while True:
            try:
                link.connect()
                break
            except TransportError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the worker did not come up within 60 s"
                time.sleep(0.2)
        prompt = [5, 6, 7]
        ids, _ = link.run(0, 0, hidden=head_engine.stage_run(0, prompt, 0))
        assert ids == list(whole.stage_run(0, prompt, 0)[0])
        link.close()
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
