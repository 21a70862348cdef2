"""/v1/chat/completions and /v1/models through the official ``openai`` SDK against a live server
(fake engine): streaming ≡ non-streamed, include_usage, tool_calls round trip, tool_choice,
reasoning_content, seeded sampling, errors in OpenAI's shape."""

from __future__ import annotations

import json

import openai
import pytest
from fake_engine import FakeEngine, LiveServer, make_app, text_script, tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def live():
    tok = tiny_tokenizer("qwen3next")
    engine = FakeEngine(
        tok.vocab_size,
        slots=2,
        script=text_script(
            tok,
            {
                "weather": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                "<tool_response>": "Cold in Oslo.",
                "two cities": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>',
            },
        ),
    )
    server = LiveServer(make_app(engine, tok, slots=2))
    yield server, engine, tok, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.close()


def test_non_streamed_and_streamed_agree(live):
    _, _, _, client = live
    kwargs = dict(
        model="x",
        max_tokens=20,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert text == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    # include_usage: one last chunk with no choices and the full usage; the others carry none.
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_tool_calls_round_trip(live):
    _, _, _, client = live
    first = client.chat.completions.create(
        model="x", max_tokens=60, tools=[WEATHER], messages=[{"role": "user", "content": "weather in Oslo?"}]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    second = client.chat.completions.create(
        model="x",
        max_tokens=60,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Oslo?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "-5 C"},
        ],
    )
    assert second.choices[0].message.content == "Cold in Oslo." and second.choices[0].finish_reason == "stop"


def test_streamed_tool_call_deltas(live):
    _, _, _, client = live
    chunks = list(
        client.chat.completions.create(
            model="x",
            max_tokens=60,
            tools=[WEATHER],
            stream=True,
            messages=[{"role": "user", "content": "weather?"}],
        )
    )
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_and_named(live):
    _, engine, tok, client = live
    client.chat.completions.create(
        model="x",
        max_tokens=3,
        tools=[WEATHER],
        tool_choice="required",
        messages=[{"role": "user", "content": "hi"}],
    )
    assert tok.decode(engine.prompts[engine.last_slot]).endswith('assistant\n<tool_call>\n{"name": "')
    r = client.chat.completions.create(
        model="x",
        max_tokens=20,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert tok.decode(engine.prompts[engine.last_slot]).endswith('{"name": "get_weather", "arguments": ')
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    client.chat.completions.create(
        model="x",
        max_tokens=3,
        tools=[WEATHER],
        tool_choice="none",
        messages=[{"role": "user", "content": "hi"}],
    )
    assert "get_weather" not in tok.decode(engine.prompts[engine.last_slot])


def test_same_seed_same_text(live):
    _, _, _, client = live
    kwargs = dict(
        model="x", max_tokens=16, temperature=1.0, top_p=0.95, messages=[{"role": "user", "content": "go"}]
    )
    a = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    others = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content for s in (8, 9, 10)}
    assert a == b
    # Three other seeds all reproducing seed 7's 16 tokens would mean the seed is ignored.
    assert others != {a}


def test_reasoning_content_with_thinking_template():
    tok = tiny_tokenizer("qwen35moe")
    engine = FakeEngine(
        tok.vocab_size, slots=1, script=text_script(tok, {"why": "Because.\n</think>\n\nYes."})
    )
    server = LiveServer(make_app(engine, tok, slots=1))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="x", max_tokens=30, messages=[{"role": "user", "content": "why?"}]
        )
        message = r.choices[0].message
        assert message.content == "Yes." and message.reasoning_content == "Because."
    finally:
        server.close()


def test_errors_in_openai_shape(live):
    server, _, _, client = live
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="x",
            max_tokens=3,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ],
        )
    assert err.value.body["type"] == "invalid_request_error" and "text only" in err.value.body["message"]
    r = server.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}
    )
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="x", max_tokens=3, messages=[{"role": "user", "content": "w " * 5000}]
        )
    assert "prompt is too long" in err.value.body["message"]


def test_models_list_both_sdks(live):
    server, _, _, client = live
    assert [m.id for m in client.models.list()] == ["qk-test"]
    import anthropic

    models = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).models.list()
    assert [m.id for m in models.data] == ["qk-test"]
    assert server.http.get("/v1/models/nope").status_code == 404


def test_queue_full_is_429_and_empty_prefill_turn_ignored():
    import threading

    tok = tiny_tokenizer()
    engine = FakeEngine(tok.vocab_size, slots=1, banned=sorted(tok.eog_ids))
    server = LiveServer(make_app(engine, tok, slots=1, max_queue=0))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    try:
        engine.gate.clear()
        first = threading.Thread(
            target=lambda: client.chat.completions.create(
                model="x", max_tokens=2, messages=[{"role": "user", "content": "a"}]
            )
        )
        first.start()
        for _ in range(500):
            if server.http.get("/slots").json()[0]["is_processing"]:
                break
            threading.Event().wait(0.01)
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(
                model="x", max_tokens=2, messages=[{"role": "user", "content": "b"}]
            )
        assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_exceeded"
        engine.gate.set()
        first.join(10)
        r = client.chat.completions.create(
            model="x",
            max_tokens=2,
            messages=[{"role": "user", "content": "b"}, {"role": "assistant", "content": ""}],
        )
        assert r.usage.completion_tokens == 2
    finally:
        engine.gate.set()
        server.close()


def test_parallel_tool_calls_false_ends_after_the_first_call(live):
    _, _, _, client = live
    kwargs = dict(
        model="x", max_tokens=120, tools=[WEATHER], messages=[{"role": "user", "content": "two cities"}]
    )

    def cities(**extra):
        reply = client.chat.completions.create(**kwargs, **extra)
        assert reply.choices[0].finish_reason == "tool_calls"
        return [json.loads(c.function.arguments)["city"] for c in reply.choices[0].message.tool_calls]

    assert cities() == ["Oslo", "Bergen"]
    assert cities(parallel_tool_calls=False) == ["Oslo"]
