"""Cross-turn reuse through the HTTP server on the real ``qk.Engine`` (lavapipe in CI) with the tiny
qwen35moe fixture served with the real Qwen3.5 chat template (llama.cpp's copy), which drops earlier
turns' reasoning once a new user query comes — on one box and across a 2-stage split (head and
worker over a real socket): multi-turn conversations with a tool loop give
byte-identical answers with reuse on and off, each turn prefills exactly its prompt minus the longest
snapshotted prefix (an older one where the template rewrote the newer), and after ``invalidate`` a
turn prefills in full and answers the same; a worker restarted between turns costs a full prefill,
never a wrong answer."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from conftest import require_gpu
from fake_engine import LiveServer

pytestmark = pytest.mark.gpu

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen35moe-f32.gguf"
CTX = 1024
# Long enough that the history passes a 64-token boundary (the fixture's small vocabulary makes
# ~1 token per 1.5 characters); the stamp differs per request. Tool definitions are left out of the
# prompts (they would add ~300 tokens of prefill on lavapipe); the conversations still carry tool
# calls and results.
SYSTEM = (
    "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={stamp};\n"
    "You are a careful assistant for the weather desk. Answer briefly and use the tools. "
)


@pytest.fixture(scope="module")
def tokenizer(llama_cpp_src: Path):
    from qk.tokenizer import Tokenizer

    template = llama_cpp_src / "models" / "templates" / "Qwen3.5-4B.jinja"
    if not template.exists():
        pytest.skip("llama.cpp's Qwen3.5 template is not unpacked")
    tok = Tokenizer.from_gguf(FIXTURE)
    tok.chat_template = template.read_text()
    return tok


class InProcessWorker:
    """``python -m qk.worker``'s parts in this process: the layers after the head's behind a real
    socket. ``restart()`` is a worker that died and came back (a new boot id, no snapshots)."""

    def __init__(self, _qk, first: int, n_layer: int) -> None:
        self._qk, self.first, self.n_layer, self.port = _qk, first, n_layer, 0
        self.start()

    def start(self) -> None:
        import threading

        from qk.gguf import Gguf
        from qk.worker import EngineStage

        engine = self._qk.Engine(str(FIXTURE), layers=(self.first, self.n_layer), slots=1, ctx=CTX)
        stage = EngineStage(engine, Gguf(str(FIXTURE), header_only=True).fingerprint, 8)
        self.worker = self._qk.Worker(stage, port=self.port, name="tail")
        self.port = self.worker.port
        self.thread = threading.Thread(target=self.worker.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module", params=["one-box", "split"])
def live(request, tokenizer):
    try:
        from qk import _qk
    except ImportError:
        if require_gpu():
            raise
        pytest.skip("qk._qk not built")
    from qk.driver import LocalDriver
    from qk.scheduler import ReuseSettings
    from qk.server import Loaded, create_app

    try:
        engine = _qk.Engine(str(FIXTURE), slots=1, ctx=CTX)
    except _qk.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")

    tail = None
    if request.param == "one-box":
        driver = LocalDriver(engine)
    else:
        # Reuse across a 2-stage split: snapshots on both stages through qkp ops 3 and 4.
        from qk.gguf import Gguf
        from qk.split import SplitDriver, head_stage

        n_layer = engine.info()["n_layer"]
        head = _qk.Engine(str(FIXTURE), layers=(0, 1), slots=1, ctx=CTX)
        tail = InProcessWorker(_qk, 1, n_layer)
        own = head_stage(head, Gguf(str(FIXTURE), header_only=True).fingerprint, 8, "head", 1)
        link = _qk.HeadLink(f"127.0.0.1:{tail.port}", own, connect_timeout=2.0)
        driver = SplitDriver(head, link, ticker=False)
        assert driver.connect()

    def load():
        return Loaded(driver, tokenizer, "tiny", str(FIXTURE))

    app = create_app(load, slots=1, ctx=CTX, reuse=ReuseSettings(max_entries=8, max_bytes=1 << 30))
    server = LiveServer(app)
    yield server, app.state.scheduler, tail
    server.close()
    if tail is not None:
        tail.stop()


def prefilled(server) -> int:
    text = server.http.get("/metrics").text
    match = re.search(r"^qk_prompt_tokens_total ([0-9.e+]+)$", text, re.M)
    assert match, text
    return int(float(match.group(1)))


@contextlib.contextmanager
def reuse_off(scheduler):
    """Serve without the table (the engine thread is idle between these sequential requests), then
    put it back untouched."""
    table = scheduler.reuse
    scheduler.reuse = None
    try:
        yield
    finally:
        scheduler.reuse = table


def counted(server, send):
    before = prefilled(server)
    response = send()
    return response, prefilled(server) - before


def test_anthropic_tool_loop_reuse_is_byte_identical(live):
    server, scheduler, _ = live
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    first = {"role": "user", "content": "What is the weather in Paris?"}
    later = [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "s"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Now answer.", "signature": "s"},
                {"type": "text", "text": "It is sunny."},
            ],
        },
        {"role": "user", "content": "And in Rome?"},
    ]
    conversations = [[first], [first, *later[:2]], [first, *later]]

    def send(n: int):
        return client.messages.create(
            model="tiny", max_tokens=6, system=SYSTEM.format(stamp=f"{n:05x}"), messages=conversations[n]
        )

    scheduler.invalidate_reuse()
    on = [counted(server, lambda n=n: send(n)) for n in range(3)]
    with reuse_off(scheduler):
        off = [counted(server, lambda n=n: send(n)) for n in range(3)]
    for (r, n_r), (f, n_f) in zip(on, off, strict=True):
        assert r.content == f.content and r.stop_reason == f.stop_reason
        assert f.usage.cache_read_input_tokens == 0 and n_f == f.usage.input_tokens
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == f.usage.input_tokens
        assert n_r == r.usage.input_tokens and r.usage.cache_read_input_tokens % 64 == 0
    # Later turns start from the shared history, which the per-request cch stamp would otherwise
    # break after ~20 tokens.
    assert on[1][0].usage.cache_read_input_tokens >= 64 and on[2][0].usage.cache_read_input_tokens >= 64
    # invalidate(): the next turn prefills in full and still answers the same.
    scheduler.invalidate_reuse()
    again, n_again = counted(server, lambda: send(2))
    assert again.content == on[2][0].content and again.usage.cache_read_input_tokens == 0
    assert n_again == again.usage.input_tokens == off[2][0].usage.input_tokens


def test_openai_tool_loop_prefills_prompt_minus_longest_snapshot(live, tokenizer):
    server, scheduler, _ = live
    from qk.chat import ChatTemplate
    from qk.reuse import snapshot_position

    template = ChatTemplate.from_tokenizer(tokenizer)
    system = {"role": "system", "content": SYSTEM.format(stamp="fffff")}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    first = [system, {"role": "user", "content": "Weather in Oslo?"}]
    second = first + [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call the tool first.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "snow, -3 C"},
    ]
    third = second + [
        {"role": "assistant", "content": "It snows.", "reasoning_content": "Answer now."},
        {"role": "user", "content": "Thanks. And Bergen?"},
    ]

    def ids(conv, gen):
        return tokenizer.encode(template.render(conv, add_generation_prompt=gen).text, special=True)

    def send(conv):
        r = server.http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": conv, "max_tokens": 6, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()

    scheduler.invalidate_reuse()
    saved: list[list[int]] = []
    expected_cached = []
    on = []
    for conv in (first, second, third):
        prompt, history = ids(conv, True), ids(conv, False)
        common = next(
            (i for i, (a, b) in enumerate(zip(prompt, history, strict=False)) if a != b), len(history)
        )
        expected = max((len(p) for p in saved if prompt[: len(p)] == p and len(p) < len(prompt)), default=0)
        expected_cached.append(expected)
        response, n = counted(server, lambda conv=conv: send(conv))
        assert response["usage"]["prompt_tokens"] == len(prompt)
        assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        assert n == len(prompt) - expected
        on.append(response)
        at = snapshot_position(common, len(prompt))
        if at:
            saved.append(prompt[:at])
    # Turn 2 continues turn 1's snapshot; the template drops turn 2's reasoning in turn 3, so turn 3
    # diverges before turn 2's snapshot and falls back to turn 1's.
    assert 0 < expected_cached[1] and expected_cached[2] == expected_cached[1] < len(saved[1])
    with reuse_off(scheduler):
        for conv, response in zip((first, second, third), on, strict=True):
            full, n = counted(server, lambda conv=conv: send(conv))
            assert full["choices"] == response["choices"]
            assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and n == len(ids(conv, True))

    # The table's byte account is what the engine really holds for the snapshots.
    memory = scheduler.driver.engine.info()["memory"]
    assert scheduler.reuse.bytes == memory["snapshots"] > 0
    metrics = server.http.get("/metrics").text
    assert f"qk_reuse_entries {float(scheduler.reuse.entries)}" in metrics
    assert re.search(r"^qk_reuse_hits_total [1-9]", metrics, re.M)


def test_completion_reports_cached_tokens(live, tokenizer):
    server, scheduler, _ = live
    scheduler.invalidate_reuse()
    prompt = tokenizer.encode("The weather desk keeps notes on every city it covers. " * 3)
    assert len(prompt) > 64

    def send(ids, cache=True):
        r = server.http.post("/completion", json={"prompt": ids, "n_predict": 4, "cache_prompt": cache})
        assert r.status_code == 200, r.text
        return r.json()

    first = send(prompt)
    follow = prompt + tokenizer.encode(" Next:")
    reused = send(follow)
    full = send(follow, cache=False)
    at = (len(prompt) - 1) // 64 * 64
    assert first["tokens_cached"] == 0
    assert reused["tokens_cached"] == reused["timings"]["cache_n"] == at
    assert reused["timings"]["prompt_n"] == len(follow) - at
    assert full["tokens_cached"] == 0 and reused["tokens"] == full["tokens"]


@pytest.mark.parametrize("live", ["split"], indirect=True)
def test_a_restarted_worker_between_turns_falls_back_to_a_full_prefill(live, tokenizer):
    server, scheduler, tail = live
    scheduler.invalidate_reuse()
    prompt = tokenizer.encode("The weather desk keeps notes on every city it covers. " * 3)
    follow = prompt + tokenizer.encode(" Next:")

    def send(ids, cache=True):
        r = server.http.post("/completion", json={"prompt": ids, "n_predict": 4, "cache_prompt": cache})
        assert r.status_code == 200, r.text
        return r.json()

    send(prompt)
    assert scheduler.reuse.entries == 1
    tail.restart()
    after = send(follow)
    assert after["tokens_cached"] == 0 and after["timings"]["prompt_n"] == len(follow)
    assert after["tokens"] == send(follow, cache=False)["tokens"]
