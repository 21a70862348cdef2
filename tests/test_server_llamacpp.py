"""llama.cpp-style routes (/completion, /health, /props, /slots, /metrics) on a live server with the
fake engine, plus robustness: generated bad bodies never give a 500, a vanished client frees its
slot, a lost device turns /health to 503, loading answers 503."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from fake_engine import FakeDeviceLost, FakeEngine, LiveServer, make_app, text_script, tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def live():
    tok = tiny_tokenizer()
    engine = FakeEngine(
        tok.vocab_size, slots=2, script=text_script(tok, {"story": "Once upon a time there was a cat."})
    )
    server = LiveServer(make_app(engine, tok, slots=2))
    yield server, engine, tok
    server.close()


def test_completion_string_and_ids(live):
    server, _, tok = live
    r = server.http.post("/completion", json={"prompt": "Once upon a", "n_predict": 6})
    body = r.json()
    assert r.status_code == 200 and body["stop"] is True and body["stop_type"] == "limit"
    assert len(body["tokens"]) == 6 and body["tokens_evaluated"] == len(tok.encode("Once upon a"))
    assert body["content"] == tok.decode(body["tokens"])
    assert set(body["timings"]) >= {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    }
    ids = server.http.post("/completion", json={"prompt": tok.encode("Once upon a"), "n_predict": 6}).json()
    assert ids["tokens"] == body["tokens"]
    mixed = server.http.post(
        "/completion", json={"prompt": ["Once upon", *tok.encode(" a")], "n_predict": 6}
    ).json()
    assert mixed["tokens_evaluated"] == len(tok.encode("Once upon")) + len(tok.encode(" a"))


def test_completion_stop_word_and_eos(live):
    server, _, tok = live
    chat = "<|im_start|>user\ntell a story<|im_end|>\n<|im_start|>assistant\n"
    full = server.http.post("/completion", json={"prompt": chat, "n_predict": 50}).json()
    assert full["content"] == "Once upon a time there was a cat." and full["stop_type"] == "eos"
    word = server.http.post("/completion", json={"prompt": chat, "n_predict": 50, "stop": ["there"]}).json()
    assert (
        word["content"] == "Once upon a time "
        and word["stop_type"] == "word"
        and word["stopping_word"] == "there"
    )


def test_completion_stream_matches(live):
    server, _, _ = live
    body = {"prompt": "abc", "n_predict": 10, "temperature": 0.9, "seed": 42}
    whole = server.http.post("/completion", json=body).json()
    chunks = []
    with server.http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert chunks[-1]["tokens"] == whole["tokens"]
    assert whole["generation_settings"]["seed"] == 42


def test_seed_reproducible(live):
    server, _, _ = live
    body = {"prompt": "xyz", "n_predict": 12, "temperature": 1.5, "top_k": 20, "seed": 3}
    a = server.http.post("/completion", json=body).json()["tokens"]
    assert a == server.http.post("/completion", json=body).json()["tokens"]
    assert a != server.http.post("/completion", json={**body, "seed": 4}).json()["tokens"]


def test_props_slots_metrics(live):
    server, _, _ = live
    props = server.http.get("/props").json()
    assert props["total_slots"] == 2 and props["modalities"]["vision"] is False
    assert "<|im_start|>" in props["chat_template"]
    slots = server.http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 4096 for s in slots)
    server.http.post("/completion", json={"prompt": "m", "n_predict": 2})
    text = server.http.get("/metrics").text
    for name in (
        "qk_prompt_tokens_total",
        "qk_generated_tokens_total",
        "qk_requests_queued",
        "qk_slots_busy",
        "qk_decode_tokens_per_second",
        "qk_prefill_tokens_per_second",
    ):
        assert f"\n{name} " in text
    assert 'qk_http_requests_total{route="/completion",status="200"}' in text


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
FIELDS = {
    "/v1/messages": [
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "thinking",
        "stream",
    ],
    "/v1/chat/completions": [
        "model",
        "max_tokens",
        "messages",
        "tools",
        "tool_choice",
        "stop",
        "temperature",
        "seed",
        "stream_options",
        "n",
    ],
    "/completion": ["prompt", "n_predict", "stop", "temperature", "top_k", "seed", "ignore_eos"],
}
GOOD = {
    "/v1/messages": {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/completion": {"prompt": "hi", "n_predict": 2},
}


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_bad_bodies_never_500(live, data):
    server, _, _ = live
    route = data.draw(st.sampled_from(sorted(FIELDS)))
    body = dict(GOOD[route])
    # Replace some known fields with arbitrary JSON (wrong types, wrong shapes), add unknown ones.
    for key in data.draw(st.lists(st.sampled_from(FIELDS[route]), max_size=3, unique=True)):
        body[key] = data.draw(JSON)
    body.update(data.draw(st.dictionaries(st.text(max_size=6), JSON, max_size=2)))
    # Generation can be long when max_tokens became large: bound it so the test stays quick.
    for key in ("max_tokens", "n_predict"):
        if (
            isinstance(body.get(key), int)
            and not isinstance(body.get(key), bool)
            and (body[key] > 4 or body[key] < 0)
        ):
            body[key] = 4
    r = server.http.post(route, json=body)
    assert r.status_code in (200, 400), (route, body, r.status_code, r.text)
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]


@given(st.binary(max_size=40))
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_garbage_bytes_are_400(live, raw):
    server, _, _ = live
    for route in FIELDS:
        assert server.http.post(route, content=raw).status_code == 400


def test_client_disconnect_frees_slot():
    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1, step_delay=0.005, banned=sorted(tok.eog_ids))
    server = LiveServer(make_app(engine, tok, slots=1))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream(
                "POST", "/completion", json={"prompt": "a", "n_predict": 100000, "stream": True}
            ) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n > 10:
                        break
        # The connection is closed; the slot must be free well before 100000 tokens.
        for _ in range(500):
            if not server.http.get("/slots").json()[0]["is_processing"]:
                break
            threading.Event().wait(0.01)
        assert not server.http.get("/slots").json()[0]["is_processing"]
        ok = server.http.post("/completion", json={"prompt": "b", "n_predict": 3}).json()
        assert len(ok["tokens"]) == 3
    finally:
        server.close()


@pytest.mark.parametrize("native", [True, False])
def test_device_lost_turns_health_503(native):
    if native:
        lost_error = pytest.importorskip("qk._qk").DeviceLostError
        status, kind = 503, "api_error"  # the table maps qk.DeviceLostError itself
    else:
        lost_error, status, kind = FakeDeviceLost, 500, "api_error"  # unknown class: generic 500
    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1)
    server = LiveServer(make_app(engine, tok, slots=1))
    body = {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "a"}]}
    try:
        engine.fail_with = lost_error("vkQueueSubmit: VK_ERROR_DEVICE_LOST")
        r = server.http.post("/v1/messages", json=body)
        assert r.status_code == status and r.json()["error"]["type"] == kind
        server.wait_health(503)
        assert "device was lost" in server.http.get("/health").json()["error"]["message"]
        r = server.http.post("/v1/messages", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
    finally:
        server.close()


def test_health_503_while_loading():
    tok = tiny_tokenizer()
    release = threading.Event()
    from qk.driver import LocalDriver
    from qk.server import Loaded, create_app

    def slow_load():
        release.wait(20)
        return Loaded(LocalDriver(FakeEngine(tok.vocab_size)), tok, "slow", None)

    server = LiveServer(create_app(slow_load, slots=1, ctx=256), wait_ready=False)
    try:
        r = server.http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        r = server.http.post(
            "/v1/messages",
            json={"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]},
        )
        assert r.status_code == 503 and r.json()["type"] == "error"
        release.set()
        server.wait_health(200)
    finally:
        release.set()
        server.close()


def test_engine_failure_mid_stream_is_an_error_event():
    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1, step_delay=0.002, banned=sorted(tok.eog_ids))
    server = LiveServer(make_app(engine, tok, slots=1))
    body = {"model": "x", "max_tokens": 500, "stream": True, "messages": [{"role": "user", "content": "a"}]}
    try:
        events = []
        with server.http.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "content_block_delta":
                        engine.fail_with = RuntimeError("shader exploded")
        # Tokens already sent stay sent; the stream ends with an error event, not a hang or a reset.
        assert any(e["type"] == "content_block_delta" for e in events)
        assert events[-1] == {
            "type": "error",
            "error": {"type": "api_error", "message": "internal server error"},
        }
        engine.fail_with = None
        ok = server.http.post("/completion", json={"prompt": "b", "n_predict": 2}).json()
        assert len(ok["tokens"]) == 2
    finally:
        server.close()


BLOCK_TYPES = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "document",
    "weird",
]
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(BLOCK_TYPES)},
    optional={
        "text": JSON,
        "id": JSON,
        "name": JSON,
        "input": JSON,
        "content": JSON
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": JSON}), max_size=2),
        "tool_use_id": JSON,
        "thinking": JSON,
        "is_error": JSON,
    },
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"])},
    optional={
        "content": st.text(max_size=20) | st.lists(BLOCK, max_size=3) | JSON,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {"id": JSON, "function": JSON | st.fixed_dictionaries({"name": JSON, "arguments": JSON})}
            ),
            max_size=2,
        ),
        "tool_call_id": JSON,
        "reasoning_content": JSON,
    },
)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    route=st.sampled_from(["/v1/messages", "/v1/chat/completions"]),
    messages=st.lists(MESSAGE, min_size=1, max_size=4),
)
def test_bad_conversations_never_500(live, route, messages):
    server, _, _ = live
    r = server.http.post(route, json={"model": "x", "max_tokens": 2, "messages": messages})
    assert r.status_code in (200, 400), (route, messages, r.status_code, r.text)
