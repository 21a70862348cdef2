"""A TEST DOUBLE of ``qk.Engine`` for the server and scheduler tests (the native engine is not
ready yet): deterministic, instant, and checking the contract the real engine enforces.

The "model": the logit of token ``t`` after history ``h`` is a hash of ``(h, t)`` mapped to
[-8, 8), so the greedy id and the top-k depend on the whole slot history, like a real model's.
A ``script`` may take over: called with the history at the end of each prefill, it may return the
exact reply tokens to produce (greedy) from there, e.g. a tool call for a round-trip test.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence

import numpy as np


class FakeDeviceLost(Exception):
    """Stands in for ``qk.DeviceLostError`` where the native module is not built."""


class FakeEngine:
    def __init__(
        self,
        n_vocab: int,
        *,
        slots: int = 2,
        ctx: int = 4096,
        script: Callable[[list[int]], list[int] | None] | None = None,
        step_delay: float = 0.0,
        banned: Sequence[int] = (),
        prefill_rows: int | None = None,
    ) -> None:
        self.n_vocab = n_vocab
        #: The engine's prefill piece as info() reports it (None: not reported, as older engines).
        self.prefill_rows = prefill_rows
        self.slots = slots
        self.ctx = ctx
        self.script = script
        self.step_delay = step_delay
        self.history: list[list[int]] = [[] for _ in range(slots)]
        self._reply: list[tuple[int, list[int]] | None] = [None] * slots
        #: Ids never produced by the hash model (e.g. the end-of-generation tokens, to control length).
        self.banned = np.zeros(n_vocab, dtype=bool)
        self.banned[list(banned)] = True
        self.calls: list[tuple[str, object]] = []
        #: Each slot's history at the end of its latest prefill (the prompt, as the engine saw it).
        self.prompts: list[list[int]] = [[] for _ in range(slots)]
        self.last_slot = 0
        self.fail_with: BaseException | None = None
        #: Set while a step runs (lets tests hold the engine mid-generation).
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()
        #: Submitted steps not yet collected, by id; the slots and greedy ids a chained step follows.
        self._steps: dict[int, list] = {}
        self._next_step = 0
        self._chain_from: tuple[tuple[int, ...], list[int]] | None = None
        #: Steps submitted with their tokens taken from the previous step (chained).
        self.chained_steps = 0

    def info(self) -> dict[str, object]:
        info: dict[str, object] = {
            "arch": "fake",
            "vocab": self.n_vocab,
            "ctx": self.ctx,
            "slots": self.slots,
        }
        if self.prefill_rows is not None:
            info["prefill_rows"] = self.prefill_rows
        return info

    def _logits(self, history: Sequence[int]) -> np.ndarray:
        digest = hashlib.blake2b(np.asarray(history, dtype=np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = rng.uniform(-8.0, 8.0, self.n_vocab)
        logits[self.banned] = -1e9
        return logits

    def _next(self, slot: int, topk: int) -> tuple[int, list[tuple[int, float]]]:
        history = self.history[slot]
        logits = self._logits(history)
        reply = self._reply[slot]
        if reply is not None:
            start, tokens = reply
            at = len(history) - start
            if 0 <= at < len(tokens):
                logits[tokens[at]] = 100.0
        order = np.lexsort((np.arange(self.n_vocab), -logits))
        top = [(int(i), float(logits[i])) for i in order[:topk]]
        return int(order[0]), top

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range")
        if self.fail_with is not None:
            raise self.fail_with

    def stage_run(self, slot: int, tokens: Sequence[int], base: int, topk: int = 0, all_ids: bool = True):
        self.gate.wait()
        with self.lock:
            self._check(slot)
            tokens = [int(t) for t in tokens]
            if any(not 0 <= t < self.n_vocab for t in tokens):
                raise ValueError("token id out of range")
            if base == 0:
                self.history[slot] = []
                self._reply[slot] = None
            elif base != len(self.history[slot]):
                raise ValueError(f"base {base} != slot {slot} position {len(self.history[slot])}")
            if base + len(tokens) > self.ctx:
                raise ValueError("context overflow")
            self.calls.append(("stage_run", (slot, len(tokens), base)))
            # The real engine's prefill overwrites the rows a chained step reads.
            self._chain_from = None
            ids = []
            for t in tokens:
                self.history[slot].append(t)
                ids.append(self._next(slot, 0)[0])
            self.prompts[slot] = list(self.history[slot])
            self.last_slot = slot
            if self.script is not None:
                reply = self.script(list(self.history[slot]))
                if reply is not None:
                    self._reply[slot] = (len(self.history[slot]), list(reply))
                    ids[-1] = self._next(slot, 0)[0]
            _, top = self._next(slot, topk)
            return (ids if all_ids else ids[-1:]), (top if topk else [])

    def step(self, slots: Sequence[int], tokens: Sequence[int], topk: int = 0):
        self.gate.wait()
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        with self.lock:
            if len(set(slots)) != len(slots) or len(slots) != len(tokens):
                raise ValueError("step needs distinct slots and one token each")
            self.calls.append(("step", tuple(slots)))
            out = []
            for slot, token in zip(slots, tokens, strict=True):
                self._check(slot)
                if len(self.history[slot]) + 1 > self.ctx:
                    raise ValueError("context overflow")
                self.history[slot].append(int(token))
                greedy, top = self._next(slot, topk)
                # The native engine's shape: each slot's result as stage_run's, ([id], top-k).
                out.append(([greedy], top if topk else []))
            self._chain_from = (tuple(slots), [ids[0] for ids, _ in out])
            return out

    def step_submit(
        self, slots: Sequence[int], tokens: Sequence[int] | None, topk: int = 0, chain_next: bool = False
    ):
        """Runs the step at once (the fake has no GPU to overlap); ``tokens=None`` feeds each slot
        the previous step's greedy id, under the real engine's rule: same slots, nothing between."""
        if tokens is None:
            if self._chain_from is None or self._chain_from[0] != tuple(slots):
                raise ValueError("a chained step follows a step over the same slots with nothing between")
            tokens = self._chain_from[1]
            self.chained_steps += 1
        out = self.step(slots, tokens, topk)
        step_id = self._next_step
        self._next_step += 1
        self._steps[step_id] = out
        return step_id

    def step_collect(self, step_id: int):
        for older in [i for i in self._steps if i < step_id]:
            del self._steps[older]
        if step_id not in self._steps:
            raise ValueError(f"decode step {step_id} is not in flight")
        return self._steps.pop(step_id)


# -- helpers for the server tests (test-only, like the engine above) ---------------------------------

_TOKENIZERS: dict[str, object] = {}


def tiny_tokenizer(arch: str = "qwen3next"):
    """The tokenizer of testmodel's tiny models (465 tokens, ChatML; qwen3next: Hermes tool calls,
    qwen35moe: XML tool calls and thinking on), built without the native module."""
    if arch not in _TOKENIZERS:
        from qk.testmodel import CHAT_TEMPLATE_QWEN3, CHAT_TEMPLATE_QWEN35, make_vocab
        from qk.tokenizer import Tokenizer

        vocab = make_vocab(200, pre="qwen2" if arch == "qwen3next" else "qwen35")
        _TOKENIZERS[arch] = Tokenizer.from_metadata(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": vocab.pre,
                "tokenizer.ggml.tokens": vocab.tokens,
                "tokenizer.ggml.token_type": vocab.token_types,
                "tokenizer.ggml.merges": vocab.merges,
                "tokenizer.ggml.bos_token_id": vocab.bos_id,
                "tokenizer.ggml.eos_token_id": vocab.eos_id,
                "tokenizer.ggml.padding_token_id": vocab.pad_id,
                "tokenizer.chat_template": CHAT_TEMPLATE_QWEN3
                if arch == "qwen3next"
                else CHAT_TEMPLATE_QWEN35,
            }
        )
    return _TOKENIZERS[arch]


def text_script(tokenizer, rules: dict[str, str]):
    """A script for FakeEngine: when the prompt's text contains a key (and ends with a generation
    prompt), the reply is the value's tokens followed by <|im_end|>."""
    end = tokenizer.token_to_id("<|im_end|>")

    def script(history: list[int]) -> list[int] | None:
        text = tokenizer.decode(history)
        # Match on the last user turn only, so a rule does not fire again on later turns.
        last_turn = text[text.rfind("<|im_start|>") :]
        if not last_turn.startswith("<|im_start|>assistant"):
            return None
        prompt_body = text[: text.rfind("<|im_start|>")]
        last_user = prompt_body[prompt_body.rfind("<|im_start|>") :]
        for key, reply in rules.items():
            if key in last_user:
                return tokenizer.encode(reply, special=True) + [end]
        return None

    return script


class LiveServer:
    """A uvicorn server on a free loopback port in a thread; ``url`` once ``/health`` answers."""

    def __init__(self, app, wait_ready: bool = True) -> None:
        import socket

        import uvicorn

        self.app = app
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
        # without it every keep-alive response waits out the client's delayed ACK (~40 ms).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        import httpx

        # One pooled client: a fresh httpx client per call costs ~0.15 s (TLS context set-up).
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self._wait_started()
        if wait_ready:
            self.wait_health(200)

    def _wait_started(self, timeout: float = 20.0) -> None:
        deadline = threading.Event()
        waited = 0.0
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            deadline.wait(0.01)
            waited += 0.01
            if waited > timeout:
                raise TimeoutError("uvicorn did not start")

    def wait_health(self, status: int, timeout: float = 20.0) -> None:
        """Poll /health until it answers ``status`` (the fake engine loads in milliseconds)."""
        import time

        end = time.monotonic() + timeout
        while True:
            got = self.http.get("/health").status_code
            if got == status:
                return
            if time.monotonic() > end:
                raise TimeoutError(f"/health stayed {got}, wanted {status}")
            threading.Event().wait(0.02)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def make_app(engine: FakeEngine, tokenizer, *, slots: int = 2, ctx: int = 4096, **kwargs):
    from qk.driver import LocalDriver
    from qk.server import Loaded, create_app

    def load():
        return Loaded(LocalDriver(engine), tokenizer, "qk-test", None)

    return create_app(load, slots=slots, ctx=ctx, device_lost_errors=(FakeDeviceLost,), **kwargs)
