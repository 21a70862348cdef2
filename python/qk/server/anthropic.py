"""Anthropic Messages API: ``POST /v1/messages`` (streamed and not) and ``/v1/messages/count_tokens``
as Anthropic specifies them. Requests become OpenAI-shaped conversations for the chat template; reply
events become content blocks (thinking, text, tool_use) with the exact SSE event order."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from qk.server import validate as v
from qk.server.errors import RequestError, UnsupportedContentError
from qk.server.generation import (
    ChatPrompt,
    Done,
    Keepalive,
    Prepared,
    ServedModel,
    render_chat,
    sampling_params,
    tool_definitions,
)
from qk.toolcalls import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart

__all__ = ["BlockAssembler", "prepare", "message_id"]

_UNSUPPORTED = {"image", "document", "search_result", "container_upload"}


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise RequestError(f"{where}: a content block must be an object")
    kind = v.string(block, "type", required=True, where=where + ".")
    if kind in _UNSUPPORTED:
        raise UnsupportedContentError(f"{where}: {kind} content is not supported: this model reads text only")
    return kind


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: expected a string or an array of text blocks")
    parts = []
    for i, block in enumerate(content):
        kind = _block_type(block, f"{where}[{i}]")
        if kind != "text":
            raise RequestError(f"{where}[{i}]: expected a text block, not {kind!r}")
        parts.append(v.string(block, "text", required=True, where=f"{where}[{i}]."))
    return "\n\n".join(parts) if where.endswith("system") else "".join(parts)


def _conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = v.array(body, "messages", required=True)
    if not messages:
        raise RequestError("messages: at least one message is required")
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where}: expected an object")
        role = v.string(message, "role", required=True, where=where + ".")
        content = message.get("content", v.MISSING)
        if content is v.MISSING:
            raise RequestError(f"{where}.content: field required")
        if role == "system":
            out.append({"role": "system", "content": _text_blocks(content, where + ".content")})
            continue
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role: must be 'user' or 'assistant'")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content: expected a string or an array of blocks")
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for i, block in enumerate(content):
            bw = f"{where}.content[{i}]"
            kind = _block_type(block, bw)
            if kind == "text":
                text.append(v.string(block, "text", required=True, where=bw + "."))
            elif kind == "thinking" and role == "assistant":
                reasoning.append(v.string(block, "thinking", required=True, where=bw + "."))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # opaque to us: nothing to show the model
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": v.string(block, "id", required=True, where=bw + "."),
                        "type": "function",
                        "function": {
                            "name": v.string(block, "name", required=True, where=bw + "."),
                            "arguments": v.obj(block, "input", {}, where=bw + "."),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                body_text = "" if result is None else _text_blocks(result, bw + ".content")
                if v.boolean(block, "is_error", False, where=bw + "."):
                    body_text = "Error: " + body_text
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": v.string(block, "tool_use_id", required=True, where=bw + "."),
                        "content": body_text,
                    }
                )
            else:
                raise RequestError(f"{bw}: a {kind!r} block is not allowed in a {role} message")
        out.extend(results)
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                turn["reasoning_content"] = "".join(reasoning)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif text or not results:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    tools = v.array(body, "tools")
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise RequestError(f"tools[{i}]: expected an object")
            v.string(tool, "name", required=True, where=f"tools[{i}].")
            v.string(tool, "description", where=f"tools[{i}].")
            v.obj(tool, "input_schema", where=f"tools[{i}].")
    choice = v.obj(body, "tool_choice", {"type": "auto"})
    kind = v.string(choice, "type", required=True, where="tool_choice.")
    if kind not in ("auto", "any", "none", "tool"):
        raise RequestError("tool_choice.type: must be one of auto, any, none, tool")
    name = v.string(choice, "name", required=True, where="tool_choice.") if kind == "tool" else None
    mode = {"auto": "auto", "any": "required", "none": "none", "tool": "required"}[kind]
    return (tool_definitions(tools) if tools else None), mode, name


def _thinking(body: dict[str, Any]) -> bool | None:
    thinking = v.obj(body, "thinking")
    if thinking is None:
        return None
    kind = v.string(thinking, "type", required=True, where="thinking.")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise RequestError("thinking.type: must be enabled, disabled or adaptive")
    return kind != "disabled"


def render(model: ServedModel, body: dict[str, Any]) -> ChatPrompt:
    v.string(body, "model", required=True)
    tools, mode, name = _tools(body)
    return render_chat(
        model,
        _conversation(body),
        tools=tools,
        tool_choice=mode,
        tool_name=name,
        enable_thinking=_thinking(body),
        new_call_id=_tool_use_id,
    )


def prepare(model: ServedModel, body: dict[str, Any]) -> Prepared:
    max_tokens = v.integer(body, "max_tokens", required=True, lo=1)
    stops = v.array(body, "stop_sequences", [])
    if not all(isinstance(s, str) for s in stops):
        raise RequestError("stop_sequences: expected an array of strings")
    params = sampling_params(
        v.number(body, "temperature", lo=0.0, hi=2.0),
        v.number(body, "top_p", lo=0.0, hi=1.0),
        v.integer(body, "top_k", lo=0),
        None,
    )
    v.boolean(body, "stream", False)
    chat = render(model, body)
    choice = v.obj(body, "tool_choice", {"type": "auto"})
    single = bool(v.boolean(choice, "disable_parallel_tool_use", False, where="tool_choice."))
    return chat.prepared(max_tokens, params, stops, single_tool_call=single)


def stop_reason(done: Done, used_tools: bool) -> str:
    if done.reason == "length":
        return "max_tokens"
    if done.reason == "stop_sequence":
        return "stop_sequence"
    return "tool_use" if used_tools else "end_turn"


class BlockAssembler:
    """Reply events → Anthropic stream events (dicts with ``type``), block indices in order.

    Whitespace-only text before a block would become an empty-looking text block; it is held and
    dropped unless more text follows."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.held_space = ""
        self.used_tools = False

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            )
        out.append({"type": "content_block_stop", "index": self.index})
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def feed(self, event: Any) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            if self.open != "text":
                if not (self.held_space + event.text).strip():
                    self.held_space += event.text
                    return []
                text, self.held_space = self.held_space + event.text, ""
                return [
                    *self._start({"type": "text", "text": ""}),
                    self._delta({"type": "text_delta", "text": text}),
                ]
            return [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ReasoningDelta):
            out = (
                []
                if self.open == "thinking"
                else self._start({"type": "thinking", "thinking": "", "signature": ""})
            )
            return [*out, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ToolCallStart):
            self.used_tools = True
            self.held_space = ""
            return self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ToolCallDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.arguments})]
        if isinstance(event, ToolCallEnd):
            return self._close()
        return []

    def finish(self) -> list[dict[str, Any]]:
        return self._close()


def fold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``content`` array that a sequence of stream events describes."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, list[str]] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial.setdefault(event["index"], []).append(delta["partial_json"])
    for index, pieces in partial.items():
        try:
            parsed = json.loads("".join(pieces))
        except json.JSONDecodeError:
            parsed = None
        blocks[index]["input"] = parsed if isinstance(parsed, dict) else {}
    return blocks


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    # Anthropic counts cache reads apart: input_tokens are only the prompt tokens computed anew.
    # Saving a snapshot is not billed as cache creation (it costs nothing extra to compute).
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def message_shell(model: ServedModel, msg_id: str, input_tokens: int) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model.name,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(input_tokens, 0),
    }


async def collect(model: ServedModel, outputs: AsyncIterator[Any], prompt_tokens: int) -> dict[str, Any]:
    assembler = BlockAssembler()
    events: list[dict[str, Any]] = []
    done: Done | None = None
    async for out in outputs:
        if isinstance(out, Done):
            done = out
        elif not isinstance(out, Keepalive):
            events.extend(assembler.feed(out))
    events.extend(assembler.finish())
    if done is None:
        raise ConnectionAbortedError("the client went away")
    message = message_shell(model, message_id(), prompt_tokens)
    message["content"] = fold(events)
    message["stop_reason"] = stop_reason(done, assembler.used_tools)
    message["stop_sequence"] = done.stop_sequence
    message["usage"] = usage(done.prompt_tokens, done.output_tokens, done.cached_tokens)
    return message


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def stream(
    model: ServedModel, outputs: AsyncIterator[Any], prompt_tokens: int
) -> AsyncIterator[dict[str, Any]]:
    """The SSE event dicts of a streamed reply, in Anthropic's order."""
    yield {"type": "message_start", "message": message_shell(model, message_id(), prompt_tokens)}
    yield {"type": "ping"}
    assembler = BlockAssembler()
    async for out in outputs:
        if isinstance(out, Keepalive):
            yield {"type": "ping"}
        elif isinstance(out, Done):
            for event in assembler.finish():
                yield event
            yield {
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(out, assembler.used_tools),
                    "stop_sequence": out.stop_sequence,
                },
                "usage": usage(out.prompt_tokens, out.output_tokens, out.cached_tokens),
            }
            yield {"type": "message_stop"}
        else:
            for event in assembler.feed(out):
                yield event
