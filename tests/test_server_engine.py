"""The server on the real ``qk.Engine`` (lavapipe in CI) with a committed tiny fixture: greedy output
through the HTTP routes equals driving the engine by hand, streamed ≡ non-streamed, and two
concurrent requests (one multi-slot step) each equal their single-sequence reference."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from conftest import require_gpu
from fake_engine import LiveServer

pytestmark = pytest.mark.gpu

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen3next-f32.gguf"
SLOTS, CTX = 2, 512


def native():
    try:
        from qk import _qk
    except ImportError:
        if require_gpu():
            raise
        pytest.skip("qk._qk not built")
    if not hasattr(_qk, "Engine"):
        pytest.skip("this build of qk._qk has no Engine yet")
    return _qk


@pytest.fixture(scope="module")
def live():
    _qk = native()
    from qk.driver import LocalDriver
    from qk.server import Loaded, create_app
    from qk.tokenizer import Tokenizer

    try:
        engine = _qk.Engine(str(FIXTURE), slots=SLOTS, ctx=CTX)
    except _qk.DeviceError:
        if require_gpu():
            raise
        pytest.skip("no wgpu adapter")
    tok = Tokenizer.from_gguf(FIXTURE)

    def load():
        return Loaded(LocalDriver(engine), tok, FIXTURE.stem, str(FIXTURE))

    server = LiveServer(create_app(load, slots=SLOTS, ctx=CTX))
    yield server, engine, tok
    server.close()


def by_hand(engine, prompt: list[int], n: int, stop_ids) -> list[int]:
    """Greedy continuation driving the engine directly (slot 0, while the server is idle)."""
    ids, _ = engine.stage_run(0, prompt, 0)
    out = [int(ids[-1])]
    while len(out) < n and out[-1] not in stop_ids:
        ((step_ids, _),) = engine.step([0], [out[-1]])
        out.append(int(step_ids[-1]))
    return [t for t in out if t not in stop_ids]


def test_completion_matches_engine(live):
    server, engine, tok = live
    prompt = tok.encode("Once upon a time")
    body = server.http.post("/completion", json={"prompt": prompt, "n_predict": 8}).json()
    assert body["tokens"] == by_hand(engine, prompt, 8, tok.eog_ids)[: len(body["tokens"])]
    assert body["content"] == tok.decode(body["tokens"])


def test_streamed_equals_non_streamed_and_concurrent(live):
    server, engine, tok = live
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "Hello"}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [getattr(b, "text", None) for b in streamed.content] == [
        getattr(b, "text", None) for b in whole.content
    ]
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    prompts = [tok.encode("The little model"), tok.encode("wanted to learn how")]
    refs = [
        server.http.post("/completion", json={"prompt": p, "n_predict": 10}).json()["tokens"] for p in prompts
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(
            pool.map(
                lambda p: server.http.post("/completion", json={"prompt": p, "n_predict": 10}).json()[
                    "tokens"
                ],
                prompts,
            )
        )
    assert together == refs
