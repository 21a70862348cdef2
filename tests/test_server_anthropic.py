"""/v1/messages and /v1/messages/count_tokens through the official ``anthropic`` SDK against a live
server (fake engine, the tiny test vocabulary): text, streaming ≡ non-streamed, exact SSE order,
tool use round trip, tool_choice, thinking, stop sequences, errors."""

from __future__ import annotations

import json

import anthropic
import pytest
from fake_engine import FakeEngine, LiveServer, make_app, text_script, tiny_tokenizer

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_CALL_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_CALL_XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def hermes():
    tok = tiny_tokenizer("qwen3next")
    engine = FakeEngine(
        tok.vocab_size,
        slots=2,
        ctx=4096,
        script=text_script(
            tok,
            {
                "weather": TOOL_CALL_HERMES,
                "<tool_response>": "It is sunny in Paris.",
                "count": "one two three four",
                "two cities": TOOL_CALL_HERMES + "\n" + TOOL_CALL_HERMES.replace("Paris", "Rome"),
            },
        ),
    )
    server = LiveServer(make_app(engine, tok, slots=2, ctx=4096))
    yield server, engine, tok
    server.close()


@pytest.fixture(scope="module")
def thinking():
    tok = tiny_tokenizer("qwen35moe")
    engine = FakeEngine(
        tok.vocab_size,
        slots=1,
        ctx=4096,
        script=text_script(
            tok, {"ponder": "Let me think.\n</think>\n\nThe answer is 4.", "weather": TOOL_CALL_XML}
        ),
    )
    server = LiveServer(make_app(engine, tok, slots=1, ctx=4096))
    yield server, engine, tok
    server.close()


_CLIENTS: dict[str, anthropic.Anthropic] = {}


def client(server) -> anthropic.Anthropic:
    # One client per server: building one (its HTTP client and TLS context) costs ~0.3 s.
    if server.url not in _CLIENTS:
        _CLIENTS[server.url] = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    return _CLIENTS[server.url]


def test_text_reply_and_usage(hermes):
    server, _, _ = hermes
    c = client(server)
    messages = [{"role": "user", "content": "Hello there"}]
    m = c.messages.create(model="any", max_tokens=12, system="Be brief.", messages=messages)
    assert m.role == "assistant" and m.type == "message"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 12
    counted = c.messages.count_tokens(model="any", system="Be brief.", messages=messages)
    assert m.usage.input_tokens == counted.input_tokens > 5
    # Greedy is deterministic.
    again = c.messages.create(model="any", max_tokens=12, system="Be brief.", messages=messages)
    assert again.content == m.content


def test_max_tokens_stops_generation(hermes):
    server, _, _ = hermes
    m = client(server).messages.create(model="x", max_tokens=3, messages=[{"role": "user", "content": "Say"}])
    # The hash model never emits <|im_end|> in 3 tokens for this prompt, or the test would be weaker.
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


@pytest.mark.parametrize(
    "system", ["plain string", [{"type": "text", "text": "block one"}, {"type": "text", "text": "two"}]]
)
def test_streamed_equals_non_streamed(hermes, system):
    server, _, _ = hermes
    c = client(server)
    kwargs = dict(
        model="x",
        max_tokens=24,
        system=system,
        messages=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": "second turn"}]},
        ],
    )
    whole = c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()

    def blocks(message):
        return [(b.type, getattr(b, "text", None), getattr(b, "thinking", None)) for b in message.content]

    assert blocks(streamed) == blocks(whole)
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens


def sse_events(server, body: dict) -> list[dict]:
    events = []
    with server.http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    return events


def check_order(events: list[dict]) -> None:
    """message_start (with usage) → per block start/delta…/stop with increasing indices →
    message_delta (cumulative usage) → message_stop; pings anywhere after message_start."""
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] > 0
    assert events[0]["message"]["stop_reason"] is None
    open_index, next_index = None, 0
    for e in events[1:]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == next_index
            open_index, next_index = e["index"], next_index + 1
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
        elif e["type"] == "message_delta":
            assert open_index is None
    assert open_index is None


def test_sse_event_order_text(hermes):
    server, _, _ = hermes
    events = sse_events(
        server,
        {"model": "x", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    check_order(events)
    assert any(e["type"] == "ping" for e in events)
    delta = [e for e in events if e["type"] == "message_delta"][0]
    assert delta["usage"]["output_tokens"] == 8 and delta["delta"]["stop_reason"] == "max_tokens"


def test_tool_use_round_trip(hermes):
    server, _, _ = hermes
    c = client(server)
    first = c.messages.create(
        model="x",
        max_tokens=80,
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].input == {"city": "Paris"}
    assert calls[0].id.startswith("toolu_")
    second = c.messages.create(
        model="x",
        max_tokens=80,
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 24 C"}],
            },
        ],
    )
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == "It is sunny in Paris."


def test_tool_use_streamed_input_json(hermes):
    server, _, _ = hermes
    body = {
        "model": "x",
        "max_tokens": 80,
        "stream": True,
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "weather please"}],
    }
    events = sse_events(server, body)
    check_order(events)
    start = [e for e in events if e["type"] == "content_block_start"][-1]
    assert start["content_block"] == {
        "type": "tool_use",
        "id": start["content_block"]["id"],
        "name": "get_weather",
        "input": {},
    }
    fragments = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == start["index"]
    ]
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def last_prompt(engine: FakeEngine, tok) -> str:
    return tok.decode(engine.prompts[engine.last_slot])


def test_tool_choice_named_forces_the_call(hermes):
    server, engine, tok = hermes
    m = client(server).messages.create(
        model="x",
        max_tokens=30,
        tools=[WEATHER_TOOL, {"name": "other", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert last_prompt(engine, tok).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
    )
    # The reply is forced to be a call of that tool (its arguments are noise from the fake model).
    assert m.content[0].type == "tool_use" and m.content[0].name == "get_weather"


def test_tool_choice_any_forces_a_call_prefix(hermes):
    server, engine, tok = hermes
    client(server).messages.create(
        model="x",
        max_tokens=5,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert last_prompt(engine, tok).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')


def test_tool_choice_none_leaves_tools_out(hermes):
    server, engine, tok = hermes
    m = client(server).messages.create(
        model="x",
        max_tokens=80,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "weather?"}],
    )
    prompt = last_prompt(engine, tok)
    assert "<tools>" not in prompt and "get_weather" not in prompt
    # The scripted model still writes a call; without tools it stays text.
    assert all(b.type == "text" for b in m.content) and m.stop_reason == "end_turn"


def test_thinking_blocks_and_signature(thinking):
    server, _, _ = thinking
    c = client(server)
    kwargs = dict(model="x", max_tokens=60, messages=[{"role": "user", "content": "ponder 2+2"}])
    m = c.messages.create(**kwargs)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me think." and m.content[1].text == "The answer is 4."
    events = sse_events(server, {**kwargs, "stream": True})
    check_order(events)
    thinking_stop = [e for e in events if e["type"] == "content_block_stop" and e["index"] == 0][0]
    before = events[events.index(thinking_stop) - 1]
    assert before["type"] == "content_block_delta" and before["delta"]["type"] == "signature_delta"
    # Thinking blocks go back into history (as reasoning_content) without error.
    follow = c.messages.create(
        model="x",
        max_tokens=5,
        messages=[
            *kwargs["messages"],
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": "ok"},
        ],
    )
    assert follow.usage.output_tokens >= 1


def test_xml_tool_call_with_thinking_template(thinking):
    server, _, _ = thinking
    m = client(server).messages.create(
        model="x", max_tokens=80, tools=[WEATHER_TOOL], messages=[{"role": "user", "content": "weather?"}]
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and calls[0].input == {"city": "Paris"}


def test_stop_sequence(hermes):
    server, _, _ = hermes
    m = client(server).messages.create(
        model="x", max_tokens=40, stop_sequences=["three"], messages=[{"role": "user", "content": "count"}]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "three"
    assert m.content[0].text == "one two "


def test_errors_in_anthropic_shape(hermes):
    server, _, _ = hermes
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(
            model="x",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "text only" in err.value.body["error"]["message"]
    assert err.value.response.headers["request-id"].startswith("req_")
    r = server.http.post("/v1/messages", json={"model": "x", "max_tokens": "5", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = server.http.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = server.http.post("/v1/nothing-here", headers={"anthropic-version": "2023-06-01"}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_prompt_too_long_message(hermes):
    server, _, _ = hermes
    with pytest.raises(anthropic.BadRequestError) as err:
        client(server).messages.create(
            model="x", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}]
        )
    message = err.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 4095 maximum")


def test_unknown_fields_ignored(hermes):
    server, _, _ = hermes
    r = server.http.post(
        "/v1/messages?beta=true",
        json={
            "model": "x",
            "max_tokens": 3,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
                }
            ],
            "metadata": {"user_id": "u"},
            "some_future_field": [1, 2],
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3


def test_queue_full_is_529_overloaded():
    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1, banned=sorted(tok.eog_ids))
    server = LiveServer(make_app(engine, tok, slots=1, max_queue=0))
    try:
        engine.gate.clear()  # hold the engine: the first request occupies the only slot
        import threading

        first_done = threading.Event()

        def first() -> None:
            client(server).messages.create(
                model="x", max_tokens=2, messages=[{"role": "user", "content": "a"}]
            )
            first_done.set()

        t = threading.Thread(target=first)
        t.start()
        # Wait until the first request holds the slot (visible in /slots), then overflow the queue.
        for _ in range(500):
            if server.http.get("/slots").json()[0]["is_processing"]:
                break
            threading.Event().wait(0.01)
        with pytest.raises(anthropic.APIStatusError) as err:
            client(server).messages.create(
                model="x", max_tokens=2, messages=[{"role": "user", "content": "b"}]
            )
        assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
        engine.gate.set()
        t.join(10)
        assert first_done.is_set()
    finally:
        engine.gate.set()
        server.close()


def test_api_key_required_except_health():
    tok = tiny_tokenizer()
    server = LiveServer(make_app(FakeEngine(tok.vocab_size), tok, api_key="s3cret"))
    try:
        assert server.http.get("/health").status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model="x", max_tokens=2, messages=[{"role": "user", "content": "a"}]
            )
        ok = anthropic.Anthropic(base_url=server.url, api_key="s3cret", max_retries=0).messages.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": "a"}]
        )
        assert ok.usage.output_tokens == 2
        assert server.http.get("/metrics").status_code == 401
        assert server.http.get("/metrics", headers={"authorization": "Bearer s3cret"}).status_code == 200
    finally:
        server.close()


def test_thinking_disabled_closes_the_think_block(thinking):
    server, engine, tok = thinking
    m = client(server).messages.create(
        model="x",
        max_tokens=4,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "hello"}],
    )
    assert tok.decode(engine.prompts[engine.last_slot]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert all(b.type != "thinking" for b in m.content)


def test_pings_while_prefill_is_slow():
    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1)
    server = LiveServer(make_app(engine, tok, slots=1, keepalive_s=0.05))
    try:
        engine.gate.clear()
        import threading

        # Release the engine after a few keep-alive periods.
        threading.Timer(0.5, engine.gate.set).start()
        events = sse_events(
            server,
            {"model": "x", "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "a"}]},
        )
        check_order(events)
        first_block = next(i for i, e in enumerate(events) if e["type"] == "content_block_start")
        assert sum(e["type"] == "ping" for e in events[:first_block]) >= 3
    finally:
        engine.gate.set()
        server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_ends_after_the_first_call(hermes, stream):
    server, _, _ = hermes
    c = client(server)
    kwargs = dict(
        model="x",
        max_tokens=120,
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "forecast for two cities"}],
    )

    def calls(**extra):
        if stream:
            with c.messages.stream(**kwargs, **extra) as s:
                reply = s.get_final_message()
        else:
            reply = c.messages.create(**kwargs, **extra)
        assert reply.stop_reason == "tool_use"
        return [b.input for b in reply.content if b.type == "tool_use"], [b.type for b in reply.content]

    both, _ = calls()
    assert both == [{"city": "Paris"}, {"city": "Rome"}]
    one, types = calls(tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert one == [{"city": "Paris"}] and types == ["tool_use"]
