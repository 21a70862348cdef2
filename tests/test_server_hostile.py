"""Hostile and careless HTTP input on a live server (fake engine): the five input classes that used to
give HTTP 500 (a lone surrogate in any string, JSON nested a thousand deep, an integer literal past
Python's digit limit, a number beyond float range, a lone surrogate in a stop string) are answered
400 in the route's own error shape before any work; generated bodies with such values injected
anywhere never give anything but 200/400/413 on any generation route (2,000 cases per route); a
body over the size bound is answered 413 without being read, chunked or not."""

from __future__ import annotations

import json
import random
import time

import pytest
from fake_engine import FakeEngine, LiveServer, make_app, tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qk.server.validate import Limits

#: Cases per route: each is one request through uvicorn (the fake engine generates instantly).
CASES = 2000
CTX = 128

ROUTES = {
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/chat/completions": "openai",
    "/completion": "llamacpp",
}


@pytest.fixture(scope="module")
def live():
    tok = tiny_tokenizer()
    # A small context bounds how long a fuzzed request without a token limit generates.
    engine = FakeEngine(tok.vocab_size, slots=2, ctx=CTX)
    server = LiveServer(
        make_app(engine, tok, slots=2, ctx=CTX, max_queue=256, limits=Limits(max_body_bytes=1 << 20))
    )
    yield server, engine
    server.close()


def check_error_shape(style: str, body: dict, status: int) -> None:
    """The error body of ``style``'s API (errors.py), and nothing that leaks an internal error."""
    if style == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif style == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    else:
        assert body["error"]["code"] == status and set(body["error"]) == {"code", "message", "type"}, body
    assert body["error"]["message"] != "internal server error", body


# -- the five classes, one by one ------------------------------------------------------------------

LONE = '"a\\ud800b"'
DEEP = "[" * 5000 + "]" * 5000
HUGE_INT = "1" + "0" * 5000
BIG_INT = "1" + "0" * 400
FLOAT_OVER = "1e400"


def anthropic_body(**over: str) -> str:
    fields = {
        "model": '"m"',
        "max_tokens": "4",
        "system": '"be brief"',
        "messages": '[{"role": "user", "content": CONTENT}]',
        "tools": '[{"name": TOOL, "input_schema": {"type": "object"}}]',
    }
    text = "{" + ", ".join(f'"{k}": {over.get(k, v)}' for k, v in fields.items())
    extra = {k: v for k, v in over.items() if k not in fields and k not in ("CONTENT", "TOOL")}
    text += "".join(f', "{k}": {v}' for k, v in extra.items()) + "}"
    return text.replace("CONTENT", over.get("CONTENT", '"hi"')).replace("TOOL", over.get("TOOL", '"t"'))


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        # A lone surrogate in content, system, tool name, prompt, stop.
        ("/v1/messages", anthropic_body(CONTENT=LONE)),
        ("/v1/messages", anthropic_body(system=LONE)),
        ("/v1/messages", anthropic_body(TOOL=LONE)),
        ("/v1/messages/count_tokens", anthropic_body(CONTENT=LONE)),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + LONE + "}]}"),
        ("/completion", '{"prompt": ' + LONE + ', "n_predict": 2}'),
        ("/completion", '{"prompt": "hi", "n_predict": 2, "stop": [' + LONE + "]}"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ' + LONE + "}"),
        # JSON nested thousands deep, anywhere.
        ("/v1/messages", anthropic_body(metadata=DEEP)),
        ("/v1/chat/completions", '{"messages": ' + DEEP + "}"),
        ("/completion", '{"prompt": "hi", "x": ' + DEEP + "}"),
        # An integer literal past Python's 4,300-digit limit.
        ("/v1/messages", anthropic_body(max_tokens=HUGE_INT)),
        ("/completion", '{"prompt": "hi", "n_predict": ' + HUGE_INT + "}"),
        # Numbers beyond float range, or an integer too big for one, in number fields.
        ("/v1/messages", anthropic_body(temperature=FLOAT_OVER)),
        ("/v1/messages", anthropic_body(temperature=BIG_INT)),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "top_p": ' + BIG_INT + "}",
        ),
        ("/completion", '{"prompt": "hi", "temperature": -' + BIG_INT + "}"),
        ("/completion", '{"prompt": "hi", "n_predict": ' + BIG_INT + "}"),
        ("/completion", '{"prompt": "hi", "top_k": ' + FLOAT_OVER + "}"),
    ],
)
def test_each_class_is_a_400_before_any_work(live, path, raw):
    server, engine = live
    calls = len(engine.calls)
    r = server.http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    check_error_shape(ROUTES[path], r.json(), 400)
    assert len(engine.calls) == calls, "the engine ran for a request that was refused"


def test_a_valid_surrogate_pair_is_text(live):
    server, _ = live
    r = server.http.post(
        "/v1/messages/count_tokens", content=anthropic_body(CONTENT='"\\ud83d\\ude00"').encode()
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


# -- generated bodies with hostile values injected anywhere ---------------------------------------

HOSTILE = st.sampled_from(
    [
        LONE,
        '"\\udfff"',
        '"\\udc00\\ud800"',
        '"\\ud83d\\ude00"',
        "[" * 70 + "]" * 70,
        "[" * 1200 + "]" * 1200,
        '{"a": ' * 3000 + "1" + "}" * 3000,
        HUGE_INT,
        BIG_INT,
        "-" + BIG_INT,
        "1" + "0" * 70,
        FLOAT_OVER,
        "-1e400",
        "1e-400",
        "NaN",
        "Infinity",
        "1.5",
        "-1",
        "0",
        "null",
        "true",
        "[]",
        "{}",
        '""',
        '"' + "ab " * 3000 + '"',
    ]
)
PLACEHOLDER = "\u0001HOSTILE\u0001"


def route_body(path: str, rnd: random.Random, text: str) -> dict:
    """A body for ``path`` built from ``rnd`` (drawing structure with hypothesis itself costs more
    than the request does), its strings ``text`` and a few fixed ones."""

    def pick(*options):
        return rnd.choice(options)

    def some(make, most=2):
        return [make() for _ in range(rnd.randint(0, most))]

    def optional(body: dict, extra: dict) -> dict:
        for key, make in extra.items():
            if rnd.random() < 0.3:
                body[key] = make()
        return body

    words = lambda: pick(text, "hi", "", "<|im_end|>", "tell a story")  # noqa: E731
    # -1 (no limit) is rare: such a request generates until the context is full.
    small = lambda: pick(1, 2, 3, 0) if rnd.random() > 0.03 else -1  # noqa: E731
    if path.startswith("/v1/messages"):
        block = lambda: {"type": "text", "text": words()}  # noqa: E731
        message = lambda: pick(  # noqa: E731
            {"role": pick("user", "assistant"), "content": words()},
            {"role": "user", "content": [block() for _ in range(rnd.randint(1, 2))]},
        )
        body = {
            "model": "m",
            "max_tokens": small(),
            "messages": [message() for _ in range(rnd.randint(1, 3))],
        }
        return optional(
            body,
            {
                "system": words,
                "temperature": lambda: rnd.uniform(0, 2),
                "top_k": small,
                "stop_sequences": lambda: some(words),
                "stream": lambda: pick(True, False),
                "tools": lambda: some(lambda: {"name": words(), "input_schema": {"type": "object"}}),
                "tool_choice": lambda: {"type": pick("auto", "any", "none", "tool"), "name": words()},
                "thinking": lambda: {"type": pick("enabled", "disabled")},
                "metadata": lambda: {"user_id": words()},
            },
        )
    if path == "/v1/chat/completions":
        message = lambda: {"role": pick("user", "assistant", "system"), "content": words()}  # noqa: E731
        body = {"messages": [message() for _ in range(rnd.randint(1, 3))], "max_tokens": small()}
        return optional(
            body,
            {
                "model": words,
                "temperature": lambda: rnd.uniform(0, 2),
                "top_p": lambda: rnd.uniform(0, 1),
                "seed": lambda: rnd.randint(-5, 2**64),
                "stop": lambda: pick(words(), some(words)),
                "stream": lambda: pick(True, False),
                "stream_options": lambda: {"include_usage": pick(True, False)},
                "tools": lambda: some(lambda: {"type": "function", "function": {"name": words()}}),
                "tool_choice": lambda: pick("auto", "none", "required"),
            },
        )
    prompt = pick(words(), [pick(words(), rnd.randint(0, 300)) for _ in range(rnd.randint(0, 3))])
    return optional(
        {"prompt": prompt, "n_predict": small()},
        {
            "temperature": lambda: rnd.uniform(0, 3),
            "top_k": small,
            "stop": lambda: some(words),
            "stream": lambda: pick(True, False),
            "seed": lambda: rnd.randint(-5, 2**64),
            "cache_prompt": lambda: pick(True, False),
        },
    )


def slots_of(node, path=()):
    """Every place in a JSON tree a value can be swapped: (path to it)."""
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from slots_of(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from slots_of(v, (*path, i))


def inject(body: dict, where: tuple, raw: str) -> str:
    """The body as JSON text with the value at ``where`` replaced by the raw JSON ``raw``."""
    if not where:
        return raw
    node = body
    for step in where[:-1]:
        node = node[step]
    node[where[-1]] = PLACEHOLDER
    return json.dumps(body).replace(json.dumps(PLACEHOLDER), raw)


CASE = st.tuples(st.integers(0, 2**32 - 1), st.text(max_size=12), st.integers(0, 9), HOSTILE)


def fuzz(server, path: str, case: tuple[int, str, int, str]) -> None:
    seed, words, inject_at, hostile = case
    rnd = random.Random(seed)
    body = route_body(path, rnd, words)
    if inject_at > 0:
        text = inject(body, rnd.choice(list(slots_of(body))), hostile)
    else:
        text = json.dumps(body)
    r = server.http.post(path, content=text.encode(), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 413), (r.status_code, text[:300], r.text[:300])
    if r.status_code != 200:
        check_error_shape(ROUTES[path], r.json(), r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "internal server error" not in r.text, r.text[-300:]


FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(case=CASE)
def test_fuzzed_messages(live, case):
    fuzz(live[0], "/v1/messages", case)


@FUZZ
@given(case=CASE)
def test_fuzzed_count_tokens(live, case):
    fuzz(live[0], "/v1/messages/count_tokens", case)


@FUZZ
@given(case=CASE)
def test_fuzzed_chat_completions(live, case):
    fuzz(live[0], "/v1/chat/completions", case)


@FUZZ
@given(case=CASE)
def test_fuzzed_completion(live, case):
    fuzz(live[0], "/completion", case)


# -- size bounds -----------------------------------------------------------------------------------


def test_an_oversized_body_is_a_413_without_being_read(live):
    server, engine = live
    calls = len(engine.calls)
    big = b'{"prompt": "' + b"a" * (3 << 20) + b'"}'
    start = time.monotonic()
    r = server.http.post("/completion", content=big)
    assert r.status_code == 413 and time.monotonic() - start < 5
    check_error_shape("llamacpp", r.json(), 413)
    # Chunked (no Content-Length): cut off once past the bound.
    r = server.http.post(
        "/v1/messages", content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "request_too_large"
    assert len(engine.calls) == calls
    # The server is fine afterwards.
    assert server.http.get("/health").status_code == 200


def test_too_many_json_values_is_a_413(live):
    server, _ = live
    raw = '{"prompt": "hi", "x": [' + ",".join(["0"] * 150_000) + "]}"
    r = server.http.post("/completion", content=raw.encode())
    assert r.status_code == 413 and "JSON values" in r.json()["error"]["message"]


def test_a_prompt_far_past_the_context_is_refused_before_tokenising(live):
    server, engine = live
    calls = len(engine.calls)
    r = server.http.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "word " * 100_000}]},
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("prompt is too long: at least ") and message.endswith(f"> {CTX - 1} maximum"), (
        message
    )
    assert len(engine.calls) == calls
