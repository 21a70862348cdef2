"""OpenAI ``POST /v1/chat/completions``: messages, tools / tool_choice,
``tool_calls`` (streamed as id+name first, then argument fragments), ``reasoning_content``,
``stream_options.include_usage``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from qk.server import validate as v
from qk.server.errors import RequestError, UnsupportedContentError
from qk.server.generation import Done, Keepalive, Prepared, ServedModel, render_chat, sampling_params
from qk.toolcalls import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart

__all__ = ["collect", "prepare", "stream"]


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where}: expected a string or an array of content parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(f"{where}[{i}]: expected an object")
        kind = v.string(part, "type", required=True, where=f"{where}[{i}].")
        if kind in ("image_url", "input_audio", "file", "image"):
            raise UnsupportedContentError(
                f"{where}[{i}]: {kind} content is not supported: this model reads text only"
            )
        if kind != "text":
            raise RequestError(f"{where}[{i}]: unsupported content part type {kind!r}")
        parts.append(v.string(part, "text", required=True, where=f"{where}[{i}]."))
    return "".join(parts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = v.array(body, "messages", required=True)
    if not messages:
        raise RequestError("messages: at least one message is required")
    out = []
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where}: expected an object")
        role = v.string(message, "role", required=True, where=where + ".")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{where}.role: unknown role {role!r}")
        turn: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where + ".content")}
        if role == "tool":
            turn["tool_call_id"] = v.string(message, "tool_call_id", "", where=where + ".")
        if role == "assistant":
            reasoning = v.string(message, "reasoning_content", where=where + ".") or v.string(
                message, "reasoning", where=where + "."
            )
            if reasoning:
                turn["reasoning_content"] = reasoning
            calls = v.array(message, "tool_calls", [], where=where + ".")
            checked = []
            for i, call in enumerate(calls):
                cw = f"{where}.tool_calls[{i}]."
                if not isinstance(call, dict):
                    raise RequestError(cw + ": expected an object")
                function = v.obj(call, "function", required=True, where=cw)
                name = v.string(function, "name", required=True, where=cw + "function.")
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, str | dict):
                    raise RequestError(cw + "function.arguments: expected a JSON string")
                checked.append(
                    {
                        "id": v.string(call, "id", "", where=cw),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            if checked:
                turn["tool_calls"] = checked
        out.append(turn)
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    tools = v.array(body, "tools")
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise RequestError(f"tools[{i}]: expected an object")
            function = v.obj(tool, "function", required=True, where=f"tools[{i}].")
            v.string(function, "name", required=True, where=f"tools[{i}].function.")
            v.obj(function, "parameters", where=f"tools[{i}].function.")
    choice = body.get("tool_choice")
    if choice is None:
        return tools or None, "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise RequestError("tool_choice: must be auto, none, required or a function")
        return tools or None, choice, None
    if not isinstance(choice, dict):
        raise RequestError("tool_choice: expected a string or an object")
    function = v.obj(choice, "function", required=True, where="tool_choice.")
    return tools or None, "required", v.string(function, "name", required=True, where="tool_choice.function.")


def prepare(model: ServedModel, body: dict[str, Any]) -> Prepared:
    v.string(body, "model")
    max_tokens = v.integer(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = v.integer(body, "max_tokens", lo=1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stops = [stop]
    elif stop is None:
        stops = []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise RequestError("stop: expected a string or an array of strings")
    params = sampling_params(
        v.number(body, "temperature", lo=0.0, hi=2.0),
        v.number(body, "top_p", lo=0.0, hi=1.0),
        v.integer(body, "top_k", lo=0),
        v.seed_value(body),
    )
    v.boolean(body, "stream", False)
    n = v.integer(body, "n", 1)
    if n != 1:
        raise RequestError("n: only 1 choice per request is supported")
    kwargs = v.obj(body, "chat_template_kwargs", {})
    thinking = v.boolean(kwargs, "enable_thinking", where="chat_template_kwargs.")
    tools, mode, name = _tools(body)
    chat = render_chat(
        model,
        _messages(body),
        tools=tools,
        tool_choice=mode,
        tool_name=name,
        enable_thinking=thinking,
        new_call_id=_call_id,
    )
    single = not v.boolean(body, "parallel_tool_calls", True)
    return chat.prepared(max_tokens, params, stops, single_tool_call=single)


def include_usage(body: dict[str, Any]) -> bool:
    options = v.obj(body, "stream_options", {})
    return bool(v.boolean(options, "include_usage", False, where="stream_options."))


def finish_reason(done: Done, used_tools: bool) -> str:
    if done.reason == "length":
        return "length"
    return "tool_calls" if used_tools and done.reason == "stop" else "stop"


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.output_tokens,
        "total_tokens": done.prompt_tokens + done.output_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _delta(event: Any) -> dict[str, Any] | None:
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        return {
            "tool_calls": [
                {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            ]
        }
    if isinstance(event, ToolCallDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
    return None


async def collect(model: ServedModel, outputs: AsyncIterator[Any]) -> dict[str, Any]:
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    done: Done | None = None
    async for out in outputs:
        if isinstance(out, Done):
            done = out
        elif isinstance(out, TextDelta):
            content.append(out.text)
        elif isinstance(out, ReasoningDelta):
            reasoning.append(out.text)
        elif isinstance(out, ToolCallStart):
            calls[out.index] = {
                "id": out.id,
                "type": "function",
                "function": {"name": out.name, "arguments": ""},
            }
        elif isinstance(out, ToolCallDelta):
            calls[out.index]["function"]["arguments"] += out.arguments
    if done is None:
        raise ConnectionAbortedError("the client went away")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:24],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model.name,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(done, bool(calls)),
                "logprobs": None,
            }
        ],
        "usage": usage(done),
    }


async def stream(model: ServedModel, outputs: AsyncIterator[Any], with_usage: bool) -> AsyncIterator[str]:
    """``data:`` payloads (JSON text, then ``[DONE]``); keep-alives are SSE comments."""
    chunk_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body: dict[str, Any] = {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model.name,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if with_usage:
            body["usage"] = None
        return json.dumps(body, ensure_ascii=False)

    yield chunk({"role": "assistant", "content": ""})
    used_tools = False
    async for out in outputs:
        if isinstance(out, Keepalive):
            yield ""
        elif isinstance(out, Done):
            yield chunk({}, finish_reason(out, used_tools))
            if with_usage:
                yield json.dumps(
                    {
                        "id": chunk_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model.name,
                        "choices": [],
                        "usage": usage(out),
                    }
                )
            yield "[DONE]"
        else:
            used_tools = used_tools or isinstance(out, ToolCallStart)
            delta = _delta(out)
            if delta is not None:
                yield chunk(delta)
