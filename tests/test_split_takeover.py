"""Two split heads with the same secret and one worker chain, each head a live HTTP server: takeover is
opt-in, and the head that loses the chain says so. A second head without ``takeover`` is refused
"busy" and the first keeps serving; a second head with it takes the chain, and then the first head's
streams end with "taken over by head X at T", its /health turns 503 naming the new head and the time
(it never reports healthy without the chain), and its new requests are refused with the same words.
The stages are test doubles (test_split_link) behind real workers, links and uvicorn servers."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

_qk = pytest.importorskip("qk._qk")
from fake_engine import LiveServer, tiny_tokenizer  # noqa: E402
from qk.server import Loaded, create_app  # noqa: E402
from qk.split import SplitDriver  # noqa: E402
from test_split_driver import Damped, HeadEngine  # noqa: E402
from test_split_link import N_LAYER, Serving  # noqa: E402

SECRET = "s3cret"
#: "taken over by head 'NAME' at 2026-11-29T08:15:02Z"
TAKEN = r"taken over by head 'head B' at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


class SmallVocab(Damped):
    """Damped stages whose ids stay inside the tiny tokenizer's vocabulary."""

    vocab = tiny_tokenizer().vocab_size

    def _id_of(self, row: np.ndarray) -> int:
        return int(abs(float(row.sum())) * 1e4) % self.vocab

    def run(self, slot, base, tokens, hidden, topk):
        out = self._advance(slot, base, self._rows(tokens, hidden))
        if not self.last:
            return out
        return [self._id_of(r) for r in out], []

    def step(self, entries, tokens, hidden, topk):
        rows = self._rows(tokens, hidden)
        out = np.concatenate([self._advance(s, b, rows[i : i + 1]) for i, (s, b) in enumerate(entries)])
        if not self.last:
            return out
        return [self._id_of(r) for r in out], [[] for _ in out]


def head_server(addr: str, name: str, *, takeover: bool) -> tuple[LiveServer, SplitDriver]:
    tok = tiny_tokenizer()
    engine = HeadEngine(SmallVocab(0, 2))
    own = engine.own(name, abs(hash(name)) % 1000 + 1)
    link = _qk.HeadLink(
        addr, own, secret=SECRET, takeover=takeover, connect_timeout=2.0, hello_timeout=10.0, backoff_max=0.5
    )
    driver = SplitDriver(engine, link, target=addr)

    def load() -> Loaded:
        driver.connect()
        return Loaded(driver, tok, name, None)

    server = LiveServer(create_app(load, slots=2, ctx=256, reuse=None), wait_ready=False)
    return server, driver


def wait_for(check, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.fixture()
def chain():
    tail = Serving(SmallVocab(4, N_LAYER), "w2", secret=SECRET)
    mid = Serving(SmallVocab(2, 4), "w1", next=tail.addr, secret=SECRET)
    yield mid, tail
    mid.stop()
    tail.stop()


def test_a_second_head_is_refused_busy_unless_it_asks_to_take_over(chain):
    mid, tail = chain
    a, driver_a = head_server(mid.addr, "head A", takeover=False)
    heads = [(a, driver_a)]
    try:
        a.wait_health(200)
        story = {"prompt": "tell a story", "n_predict": 400, "stream": True}
        # The chain slows down so that head A's streams are mid-flight when head B arrives.
        mid.stage.delay = tail.stage.delay = 0.01

        # Without --takeover: refused "busy", and head A goes on serving.
        c, driver_c = head_server(mid.addr, "head C", takeover=False)
        heads.append((c, driver_c))
        health = wait_for(lambda: c.http.get("/health").json().get("error"))
        assert "busy" in health["message"] and "a head session is live (from 'head A')" in health["message"]
        assert a.http.get("/health").status_code == 200

        streams = [a.http.stream("POST", "/completion", json=story) for _ in range(2)]
        responses = [s.__enter__() for s in streams]
        lines = []
        for r in responses:
            assert r.status_code == 200
            lines.append(r.iter_lines())
            next(lines[-1])

        # With --takeover: head B gets the chain.
        b, driver_b = head_server(mid.addr, "head B", takeover=True)
        heads.append((b, driver_b))
        b.wait_health(200)

        # Head A's streams end with the reason, not "the connection closed waiting for a message".
        for r, s in zip(lines, streams, strict=True):
            events = [json.loads(line[6:]) for line in r if line.startswith("data: ")]
            s.__exit__(None, None, None)
            assert "error" in events[-1], events[-1]
            assert re.search(TAKEN, events[-1]["error"]["message"]), events[-1]

        # Head A's /health says who took the chain and when; it is not healthy without it.
        r = a.http.get("/health")
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert message.startswith("this head lost the pipeline chain: ") and re.search(TAKEN, message), (
            message
        )
        assert re.fullmatch(TAKEN, r.json()["chain"]["taken_over"]), r.json()["chain"]
        # Its clients are told the same, at once.
        r = a.http.post("/completion", json={"prompt": "hi", "n_predict": 2})
        assert r.status_code == 503 and re.search(TAKEN, r.json()["error"]["message"]), r.text
        assert b.http.post("/completion", json={"prompt": "hi", "n_predict": 2}).status_code == 200
        # Head A never takes the chain back by itself while head B holds it.
        time.sleep(1.5)
        assert a.http.get("/health").status_code == 503
        assert b.http.get("/health").status_code == 200
    finally:
        for server, driver in heads:
            server.close()
            driver.close()


def test_a_head_that_lost_the_chain_notices_while_idle(chain):
    mid, _ = chain
    a, driver_a = head_server(mid.addr, "head A", takeover=False)
    b = None
    try:
        a.wait_health(200)
        b, driver_b = head_server(mid.addr, "head B", takeover=True)
        b.wait_health(200)
        # No request on head A: its link's ticker reads the chain's notice within a few ticks.
        start = time.monotonic()
        body = wait_for(lambda: a.http.get("/health").json().get("error"), timeout=5)
        assert re.search(TAKEN, body["message"]), body
        assert time.monotonic() - start < 3
    finally:
        a.close()
        driver_a.close()
        if b is not None:
            b.close()
            driver_b.close()
