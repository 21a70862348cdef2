"""llama.cpp server's native ``POST /completion``: raw prompt (a string,
token ids, or a mix) in; ``content``, ``tokens``, ``stop``, ``stop_type``, ``timings`` out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from qk.server import validate as v
from qk.server.errors import RequestError
from qk.server.generation import Done, Keepalive, Prepared, ServedModel, sampling_params
from qk.toolcalls import TextDelta

__all__ = ["collect", "prepare", "stream"]


def _prompt_ids(model: ServedModel, prompt: Any) -> list[int]:
    n_vocab = model.tokenizer.vocab_size
    pieces = prompt if isinstance(prompt, list) else [prompt]
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, str):
            ids.extend(model.tokenizer.encode(piece, special=True))
        elif isinstance(piece, int) and not isinstance(piece, bool):
            if not 0 <= piece < n_vocab:
                raise RequestError(f"prompt: token id {piece} is outside the vocabulary [0, {n_vocab})")
            ids.append(piece)
        else:
            raise RequestError("prompt: expected a string, token ids, or a list mixing them")
    if not ids:
        raise RequestError("prompt: empty")
    return ids


def prepare(model: ServedModel, body: dict[str, Any]) -> Prepared:
    if "prompt" not in body:
        raise RequestError("prompt: field required")
    n_predict = v.integer(body, "n_predict", -1, lo=-1)
    stops = v.array(body, "stop", [])
    if not all(isinstance(s, str) for s in stops):
        raise RequestError("stop: expected an array of strings")
    params = sampling_params(
        v.number(body, "temperature", lo=0.0, hi=100.0),
        v.number(body, "top_p", lo=0.0, hi=1.0),
        v.integer(body, "top_k", lo=0),
        v.seed_value(body),
    )
    v.boolean(body, "stream", False)
    prompt = _prompt_ids(model, body["prompt"])
    # A raw prompt has no conversation structure: the whole of it is the prefix a follow-up may share.
    cache_prompt = v.boolean(body, "cache_prompt", True)
    return Prepared(
        prompt,
        None if n_predict < 0 else n_predict,
        params,
        stops,
        parser=None,
        ignore_eos=bool(v.boolean(body, "ignore_eos", False)),
        history=len(prompt) if cache_prompt else 0,
        use_cache=bool(cache_prompt),
    )


def _stop_type(done: Done) -> str:
    return {"stop": "eos", "length": "limit", "stop_sequence": "word"}.get(done.reason, "none")


def final_fields(model: ServedModel, prepared: Prepared, done: Done, content: str) -> dict[str, Any]:
    params = prepared.params
    return {
        "content": content,
        "tokens": done.output_ids,
        "id_slot": -1,
        "stop": True,
        "stop_type": _stop_type(done),
        "stopping_word": done.stop_sequence or "",
        "model": model.name,
        "tokens_predicted": done.output_tokens,
        "tokens_evaluated": done.prompt_tokens,
        "tokens_cached": done.cached_tokens,
        "truncated": False,
        "generation_settings": {
            "n_predict": -1 if prepared.max_tokens is None else prepared.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop": prepared.stop_strings,
            "ignore_eos": prepared.ignore_eos,
        },
        "timings": timings(done),
    }


def timings(done: Done) -> dict[str, float]:
    def per_second(n: int, ms: float) -> float:
        return n * 1000.0 / ms if ms > 0 else 0.0

    # As llama-server: prompt_n counts the tokens prefilled, cache_n those restored from a cache.
    prefilled = done.prompt_tokens - done.cached_tokens
    return {
        "cache_n": done.cached_tokens,
        "prompt_n": prefilled,
        "prompt_ms": done.prompt_ms,
        "prompt_per_token_ms": done.prompt_ms / prefilled if prefilled else 0.0,
        "prompt_per_second": per_second(prefilled, done.prompt_ms),
        "predicted_n": done.output_tokens,
        "predicted_ms": done.decode_ms,
        "predicted_per_token_ms": done.decode_ms / done.output_tokens if done.output_tokens else 0.0,
        "predicted_per_second": per_second(done.output_tokens, done.decode_ms),
    }


async def collect(model: ServedModel, prepared: Prepared, outputs: AsyncIterator[Any]) -> dict[str, Any]:
    text: list[str] = []
    done: Done | None = None
    async for out in outputs:
        if isinstance(out, TextDelta):
            text.append(out.text)
        elif isinstance(out, Done):
            done = out
    if done is None:
        raise ConnectionAbortedError("the client went away")
    return final_fields(model, prepared, done, "".join(text))


async def stream(model: ServedModel, prepared: Prepared, outputs: AsyncIterator[Any]) -> AsyncIterator[str]:
    """``data:`` payloads: ``content``/``stop:false`` chunks, then the full final object."""
    async for out in outputs:
        if isinstance(out, Keepalive):
            yield ""
        elif isinstance(out, TextDelta):
            yield json.dumps({"content": out.text, "tokens": [], "stop": False}, ensure_ascii=False)
        elif isinstance(out, Done):
            yield json.dumps(final_fields(model, prepared, out, ""), ensure_ascii=False)
