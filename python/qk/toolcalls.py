"""Parse a model's reply into answer text, reasoning and structured tool calls, as it streams.

Two Qwen tool-call syntaxes, chosen from the chat template text (docs/numerics.md "Vocabulary"):

* Hermes JSON (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``
* Qwen3-Coder / Qwen3.5 XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>``, each VALUE typed by the tool's JSON schema.

Reasoning is the text inside ``<think>…</think>``; a reply to a prompt that ends in an open
``<think>`` starts as reasoning. ``ReplyParser`` takes text pieces in any split and emits events;
events of any split fold to the same ``ParsedReply``. A marker's partial prefix at the end of the
input is held back until it resolves, never shown as text. A malformed call becomes plain text.

Example::

    parser = ReplyParser(ToolFormat.HERMES, tools=tools)
    for piece in stream:
        for event in parser.feed(piece):
            send(event)
    tail = parser.finish()
    reply = parser.result()   # ParsedReply(content, reasoning, tool_calls)
"""

from __future__ import annotations

import ast
import enum
import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Event",
    "ParsedReply",
    "ReasoningDelta",
    "ReplyParser",
    "TextDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "ToolFormat",
    "detect_tool_format",
    "fold_events",
    "parse_reply",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    QWEN_XML = "qwen_xml"
    #: The template has no tool-call syntax: ``<tool_call>`` is ordinary text.
    NONE = "none"


def detect_tool_format(template: str | None) -> ToolFormat:
    """The tool-call syntax a chat template teaches its model (as exo's ``infer_tool_parser``)."""
    if not template:
        return ToolFormat.NONE
    if FUNCTION_OPEN in template and PARAMETER_OPEN in template:
        return ToolFormat.QWEN_XML
    if TOOL_OPEN in template:
        return ToolFormat.HERMES
    return ToolFormat.NONE


# -- events -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of the call's arguments JSON; a call's fragments concatenate to one JSON object."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd


@dataclass
class ToolCall:
    id: str
    name: str
    #: The arguments JSON exactly as streamed.
    arguments_json: str = ""

    @property
    def arguments(self) -> Any:
        """The parsed arguments (normally a dict); None where the model wrote invalid JSON."""
        try:
            return json.loads(self.arguments_json) if self.arguments_json else {}
        except json.JSONDecodeError:
            return None


@dataclass
class ParsedReply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def fold_events(events: Iterable[Event]) -> ParsedReply:
    """The whole reply that a sequence of events describes."""
    reply = ParsedReply()
    content: list[str] = []
    reasoning: list[str] = []
    by_index: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, TextDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            by_index[event.index] = ToolCall(event.id, event.name)
            reply.tool_calls.append(by_index[event.index])
        elif isinstance(event, ToolCallDelta):
            by_index[event.index].arguments_json += event.arguments
    reply.content = "".join(content)
    reply.reasoning = "".join(reasoning)
    return reply


def parse_reply(
    text: str,
    tool_format: ToolFormat,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    starts_in_reasoning: bool = False,
    new_call_id: Callable[[], str] | None = None,
) -> ParsedReply:
    """Non-streamed parse: the same machine as ``ReplyParser`` fed ``text`` at once."""
    parser = ReplyParser(
        tool_format, tools=tools, starts_in_reasoning=starts_in_reasoning, new_call_id=new_call_id
    )
    parser.feed(text)
    parser.finish()
    return parser.result()


# -- schema typing of XML parameter values ----------------------------------------------------------


def _tool_parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name → its parameters' JSON-schema ``properties``; OpenAI (``function.parameters``) and
    Anthropic (``input_schema``) tool shapes both accepted."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        spec = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = spec.get("name")
        if not isinstance(name, str):
            continue
        params = spec.get("parameters", spec.get("input_schema"))
        props = params.get("properties") if isinstance(params, Mapping) else None
        schemas[name] = dict(props) if isinstance(props, Mapping) else {}
    return schemas


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    types = (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types |= _schema_types(option)
    return types


def _typed_value(raw: str, schema: Any) -> Any:
    """An XML parameter value converted by its schema type; what does not convert stays a string."""
    types = _schema_types(schema)
    text = raw.strip()
    if text.lower() in ("null", "none") and ("null" in types or (types and "string" not in types)):
        return None
    if not types or "string" in types:
        return raw
    if "integer" in types:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            return int(number) if number.is_integer() and re.fullmatch(r"[+-]?\d+", text) else number
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"object", "array"}:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            try:
                # Models sometimes write Python literals (single quotes, True/None).
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw
            return value if isinstance(value, dict | list) else raw
    return raw


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _partial_marker_length(buffer: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:size]):
                longest = size
                break
    return longest


def _earliest(buffer: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    found: tuple[int, str] | None = None
    for marker in markers:
        at = buffer.find(marker, start)
        if at >= 0 and (found is None or at < found[0]):
            found = (at, marker)
    return found


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_ARGUMENTS_VALUE = re.compile(r'"arguments"\s*:\s*\S')
_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]+)>\n?")
_PARAMETER_HEAD = re.compile(r"\s*<parameter=([^>\n]+)>")
_BROKEN_PARAMETER_HEAD = re.compile(r"\s*<parameter=[^>\n]*\n")


# What ends an XML parameter value: its own close tag or, when the model forgot it, the next
# parameter, the end of the function or of the block.
_PARAMETER_TERMINATORS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CLOSE)
_LONGEST_TERMINATOR = max(len(t) for t in _PARAMETER_TERMINATORS)


class _Mode(enum.Enum):
    TEXT = 1
    REASONING = 2
    TOOL = 3


class ReplyParser:
    """Incremental parser of one reply. ``feed`` pieces, then ``finish``; ``result`` folds all
    events emitted so far. Never raises on model output.

    ``tools`` (OpenAI or Anthropic tool definitions) types XML parameter values and limits calls to
    the declared names; pass the request's list, empty when it declared none, so that tags the
    model writes unprompted stay text. ``tools=None`` accepts any name, values untyped.
    """

    def __init__(
        self,
        tool_format: ToolFormat,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        starts_in_reasoning: bool = False,
        new_call_id: Callable[[], str] | None = None,
    ) -> None:
        self.tool_format = tool_format
        self._schemas = _tool_parameter_schemas(tools)
        # With a tool list (even an empty one) a call to a name not on it is not a call: it stays
        # text. None accepts any name.
        self._known_names = set(self._schemas) if tools is not None else None
        self._new_call_id = new_call_id or (lambda: "call_" + uuid.uuid4().hex[:24])
        self._mode = _Mode.REASONING if starts_in_reasoning else _Mode.TEXT
        self._buffer = ""
        self._events: list[Event] = []
        self._finished = False
        # Whitespace held back at the end of answer text: dropped if a tool call follows it.
        self._held_space = ""
        # Newlines held back at the end of reasoning: dropped if `</think>` follows them.
        self._held_newlines = ""
        self._trim_text_start = False
        self._trim_reasoning_start = starts_in_reasoning
        self._calls_started = 0
        self._call: _CallState | None = None
        self._answer_started = False

    # -- public API -----------------------------------------------------------------------------

    def feed(self, piece: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buffer += piece
        start = len(self._events)
        self._advance(final=False)
        return self._events[start:]

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        start = len(self._events)
        self._advance(final=True)
        if self._mode is _Mode.TOOL:
            self._finish_call_at_end()
        elif self._mode is _Mode.TEXT:
            self._emit_text(self._buffer)
        else:
            self._emit_reasoning(self._buffer)
        self._buffer = ""
        if self._calls_started == 0 and self._held_space:
            self._events.append(TextDelta(self._held_space))
        self._held_space = ""
        self._finished = True
        return self._events[start:]

    @property
    def events(self) -> list[Event]:
        return list(self._events)

    def result(self) -> ParsedReply:
        return fold_events(self._events)

    # -- the state machine ----------------------------------------------------------------------

    def _markers(self, mode: _Mode) -> list[str]:
        tools = [TOOL_OPEN] if self.tool_format is not ToolFormat.NONE else []
        if mode is _Mode.TEXT:
            # Reasoning comes first in a reply; once the answer has begun, "<think>" is just text
            # (a model explaining the tag, say).
            return tools if self._answer_started else [THINK_OPEN, *tools]
        # `<tool_call>` also ends reasoning: a model that starts a call has stopped thinking, and
        # swallowing the call into reasoning would lose it.
        return [THINK_CLOSE, *tools]

    def _advance(self, final: bool) -> None:
        while True:
            if self._mode is _Mode.TOOL:
                if not self._advance_call(final):
                    return
                continue
            markers = self._markers(self._mode)
            found = _earliest(self._buffer, markers)
            if found is None:
                keep = 0 if final else _partial_marker_length(self._buffer, markers)
                if not final:
                    ready, self._buffer = (
                        self._buffer[: len(self._buffer) - keep],
                        self._buffer[len(self._buffer) - keep :],
                    )
                    self._emit(ready)
                return
            at, marker = found
            before, self._buffer = self._buffer[:at], self._buffer[at + len(marker) :]
            if self._mode is _Mode.TEXT:
                if marker == TOOL_OPEN:
                    self._emit_text(before)
                    # Dropped if this is a call, given back if the block turns out to be text.
                    space, self._held_space = self._held_space, ""
                    self._start_block(space)
                elif before.strip():
                    # Text came first: this "<think>" belongs to the answer.
                    self._emit_text(before + marker)
                else:
                    # Only whitespace before the block: nothing of the answer yet.
                    self._held_space = ""
                    self._mode = _Mode.REASONING
                    self._trim_reasoning_start = True
            else:
                self._emit_reasoning(before)
                self._held_newlines = ""
                if marker == TOOL_OPEN:
                    self._start_block()
                else:
                    self._mode = _Mode.TEXT
                    self._trim_text_start = True

    def _emit(self, text: str) -> None:
        if self._mode is _Mode.TEXT:
            self._emit_text(text)
        else:
            self._emit_reasoning(text)

    def _emit_text(self, text: str) -> None:
        if self._trim_text_start:
            text = text.lstrip("\n")
            if text:
                self._trim_text_start = False
        combined = self._held_space + text
        body = combined.rstrip()
        self._held_space = combined[len(body) :]
        if body:
            self._events.append(TextDelta(body))
            self._answer_started = True

    def _emit_reasoning(self, text: str) -> None:
        if self._trim_reasoning_start:
            text = text.lstrip("\n")
            if text:
                self._trim_reasoning_start = False
        combined = self._held_newlines + text
        body = combined.rstrip("\n")
        self._held_newlines = combined[len(body) :]
        if body:
            self._events.append(ReasoningDelta(body))

    # -- tool-call blocks -----------------------------------------------------------------------

    def _start_block(self, space_before: str = "") -> None:
        self._mode = _Mode.TOOL
        self._call = _CallState(space_before=space_before)

    def _begin_call(self, name: str) -> int:
        self._answer_started = True
        index = self._calls_started
        self._calls_started += 1
        self._events.append(ToolCallStart(index, self._new_call_id(), name))
        return index

    def _name_allowed(self, name: str) -> bool:
        return bool(name) and (self._known_names is None or name in self._known_names)

    def _close_block(self, rest_after_close: str) -> None:
        self._buffer = rest_after_close
        self._call = None
        self._mode = _Mode.TEXT

    def _advance_call(self, final: bool) -> bool:
        """Consume what can be consumed of the open ``<tool_call>`` block; True when the block
        closed (parsing continues in text mode), False when more input is needed."""
        call = self._call
        assert call is not None
        if call.index is None and not call.buffered_only:
            self._try_incremental_head(call)
        if call.index is not None:
            return self._advance_incremental(call, final)
        # Not (yet) recognisable as a streaming call: wait for the close tag and parse the block whole.
        at = self._buffer.find(TOOL_CLOSE, max(0, call.scanned - len(TOOL_CLOSE) + 1))
        if at < 0:
            call.scanned = len(self._buffer)
            return False
        block, rest = self._buffer[:at], self._buffer[at + len(TOOL_CLOSE) :]
        self._emit_whole_block(block)
        self._close_block(rest)
        return True

    def _try_incremental_head(self, call: _CallState) -> None:
        buffer = self._buffer
        if self.tool_format is ToolFormat.QWEN_XML:
            head = _FUNCTION_HEAD.match(buffer)
            if head is None:
                stripped = buffer.lstrip()
                if stripped and not FUNCTION_OPEN.startswith(stripped[: len(FUNCTION_OPEN)]):
                    call.buffered_only = True
                elif "\n" in stripped[len(FUNCTION_OPEN) :] or ">" in stripped:
                    call.buffered_only = True  # `<function=` without a well-formed name
                return
            name = head.group(1).strip()
            if not self._name_allowed(name):
                call.buffered_only = True
                return
            call.index = self._begin_call(name)
            call.tool = name
            self._buffer = buffer[head.end() :]
        else:
            head = _HERMES_HEAD.match(buffer)
            if head is None:
                stripped = buffer.lstrip()
                # Anything but the `{"name": …, "arguments": …` shape goes through the whole-block path.
                if (stripped and not stripped.startswith("{")) or _ARGUMENTS_VALUE.search(stripped):
                    call.buffered_only = True
                return
            try:
                name = json.loads('"' + head.group(1) + '"')
            except json.JSONDecodeError:
                call.buffered_only = True
                return
            if not self._name_allowed(name):
                call.buffered_only = True
                return
            call.index = self._begin_call(name)
            self._buffer = buffer[head.end() :]

    def _advance_incremental(self, call: _CallState, final: bool) -> bool:
        if self.tool_format is ToolFormat.QWEN_XML:
            return self._advance_xml(call, final)
        return self._advance_hermes(call, final)

    def _advance_hermes(self, call: _CallState, final: bool) -> bool:
        assert call.index is not None
        if not call.arguments_done:
            # The arguments end at the latest where the block does: an unfinished object followed by
            # `</tool_call>` is a truncated call, not arguments that swallow the rest of the reply,
            # unless the tag sits inside a JSON string, where it is part of a value.
            scanner, buffer, pos = call.json_scanner, self._buffer, 0
            while True:
                close = buffer.find(TOOL_CLOSE, pos)
                if close >= 0:
                    limit = close
                else:
                    limit = len(buffer) - (0 if final else _partial_marker_length(buffer, [TOOL_CLOSE]))
                consumed, done = scanner.scan(buffer[pos:limit])
                pos += consumed
                if done or close < 0 or not scanner.in_string:
                    break
                scanner.scan(TOOL_CLOSE)
                pos = close + len(TOOL_CLOSE)
            if pos:
                self._events.append(ToolCallDelta(call.index, buffer[:pos]))
                self._buffer = buffer[pos:]
            if not done and close < 0:
                return False
            call.arguments_done = True
        at = self._buffer.find(TOOL_CLOSE)
        if at < 0:
            return False
        # What sits between the arguments and the close tag is the object's own `}`.
        self._events.append(ToolCallEnd(call.index))
        self._close_block(self._buffer[at + len(TOOL_CLOSE) :])
        return True

    def _advance_xml(self, call: _CallState, final: bool) -> bool:
        assert call.index is not None and call.tool is not None
        while True:
            buffer = self._buffer
            if call.function_open:
                if call.parameter is not None:
                    if not self._advance_parameter(call, call.parameter, final):
                        return False
                    continue
                param = _PARAMETER_HEAD.match(buffer)
                if param is not None:
                    self._open_parameter(call, param.group(1).strip())
                    self._buffer = buffer[param.end() :]
                    continue
                stripped = buffer.lstrip()
                if stripped.startswith(FUNCTION_CLOSE) or stripped.startswith(TOOL_CLOSE):
                    self._end_function(call)
                    if stripped.startswith(FUNCTION_CLOSE):
                        self._buffer = stripped[len(FUNCTION_CLOSE) :]
                    else:
                        self._buffer = stripped
                    continue
                broken = _BROKEN_PARAMETER_HEAD.match(buffer)
                if broken is not None:
                    self._buffer = buffer[broken.end() :]
                    continue
                # Stray text inside the function: skip to the next tag that means something.
                nxt = _earliest(buffer, (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CLOSE))
                if nxt is not None and nxt[0] > 0:
                    self._buffer = buffer[nxt[0] :]
                    continue
                return False
            stripped = buffer.lstrip()
            if stripped.startswith(TOOL_CLOSE):
                self._close_block(stripped[len(TOOL_CLOSE) :])
                return True
            head = _FUNCTION_HEAD.match(buffer)
            if head is not None and self._name_allowed(head.group(1).strip()):
                # Another function in the same block: a second call.
                call.reset_function(self._begin_call(head.group(1).strip()), head.group(1).strip())
                self._buffer = buffer[head.end() :]
                continue
            nxt = _earliest(buffer, (TOOL_CLOSE,))
            if nxt is not None:
                self._buffer = buffer[nxt[0] :]
                continue
            return False

    def _open_parameter(self, call: _CallState, key: str) -> None:
        assert call.index is not None and call.tool is not None
        schema = self._schemas.get(call.tool, {}).get(key)
        types = _schema_types(schema)
        # A value that can only be a string is streamed as it comes (a long file body shows up
        # progressively); any other waits for its end to be typed.
        streams = (not types or "string" in types) and "null" not in types
        head = ("{" if call.parameters == 0 else ", ") + _json(key) + ": "
        call.parameters += 1
        call.parameter = _OpenParameter(key, schema, streams, head)
        if streams:
            self._events.append(ToolCallDelta(call.index, head + '"'))

    def _advance_parameter(self, call: _CallState, param: _OpenParameter, final: bool) -> bool:
        """Consume the open parameter's value; True once it ended (at one of its terminators, or
        at the end of the reply when ``final``)."""
        assert call.index is not None
        buffer = self._buffer
        # The format puts the value on its own lines: one newline after the tag, one before the close.
        if not param.started and param.streams:
            if not buffer:
                return final and self._close_parameter(call, param, "")
            param.started = True
            if buffer.startswith("\n"):
                buffer = self._buffer = buffer[1:]
        search_from = max(0, param.scanned - (_LONGEST_TERMINATOR - 1))
        end = _earliest(buffer, _PARAMETER_TERMINATORS, search_from)
        if end is None and not final:
            if param.streams:
                ready = len(buffer) - _partial_marker_length(buffer, _PARAMETER_TERMINATORS)
                if ready > 0 and buffer[ready - 1] == "\n":
                    ready -= 1  # possibly the newline that precedes the closing tag
                if ready > 0:
                    self._events.append(ToolCallDelta(call.index, _json(buffer[:ready])[1:-1]))
                    buffer = self._buffer = buffer[ready:]
            param.scanned = len(buffer)
            return False
        at, marker = end if end is not None else (len(buffer), "")
        self._buffer = buffer[at + (len(PARAMETER_CLOSE) if marker == PARAMETER_CLOSE else 0) :]
        return self._close_parameter(call, param, buffer[:at])

    def _close_parameter(self, call: _CallState, param: _OpenParameter, rest: str) -> bool:
        assert call.index is not None
        if not param.streams and rest.startswith("\n"):
            rest = rest[1:]
        if rest.endswith("\n"):
            rest = rest[:-1]
        if param.streams:
            self._events.append(ToolCallDelta(call.index, _json(rest)[1:-1] + '"'))
        else:
            self._events.append(
                ToolCallDelta(call.index, param.head + _json(_typed_value(rest, param.schema)))
            )
        call.parameter = None
        return True

    def _end_function(self, call: _CallState) -> None:
        assert call.index is not None
        self._events.append(ToolCallDelta(call.index, "{}" if call.parameters == 0 else "}"))
        self._events.append(ToolCallEnd(call.index))
        call.function_open = False

    def _finish_call_at_end(self) -> None:
        """The reply ended inside a ``<tool_call>`` block (EOS, or the length limit)."""
        call = self._call
        assert call is not None
        if call.index is None:
            # Never recognised as a call: try the block whole, else it was text.
            self._emit_whole_block(self._buffer, closed=False)
        elif self.tool_format is ToolFormat.QWEN_XML:
            if call.function_open:
                self._end_function(call)
        else:
            self._events.append(ToolCallEnd(call.index))
        self._call = None
        self._mode = _Mode.TEXT

    def _emit_whole_block(self, block: str, closed: bool = True) -> None:
        parsed = _parse_block_json(block) or _parse_block_xml(block, self._schemas)
        if parsed is not None and self._name_allowed(parsed[0]):
            name, arguments = parsed
            index = self._begin_call(name)
            self._events.append(ToolCallDelta(index, arguments))
            self._events.append(ToolCallEnd(index))
            return
        # Malformed: the model's text stands as it was written.
        space = self._call.space_before if self._call is not None else ""
        self._emit_text(space + TOOL_OPEN + block + (TOOL_CLOSE if closed else ""))


class _JsonValueScanner:
    """Finds where one JSON value ends in streamed text (strings and nesting respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.scalar = False

    def scan(self, text: str) -> tuple[int, bool]:
        """(characters of ``text`` belonging to the value, whether the value is complete)."""
        for i, ch in enumerate(text):
            if not self.started:
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_string = True
                    self.scalar = True
                else:
                    self.scalar = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1, True
                continue
            if self.depth == 0:
                # A bare scalar (number, true, null) ends where the enclosing object resumes.
                if ch in ",}" or ch.isspace():
                    return i, True
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


@dataclass
class _OpenParameter:
    key: str
    schema: Any
    #: String-valued: streamed as JSON string fragments, else typed and sent whole at its end.
    streams: bool
    #: `{"key": ` or `, "key": `.
    head: str
    started: bool = False
    #: How much of the buffer has been searched for a terminator already.
    scanned: int = 0


@dataclass
class _CallState:
    index: int | None = None
    tool: str | None = None
    buffered_only: bool = False
    space_before: str = ""
    arguments_done: bool = False
    function_open: bool = True
    parameters: int = 0
    parameter: _OpenParameter | None = None
    scanned: int = 0
    json_scanner: _JsonValueScanner = field(default_factory=_JsonValueScanner)

    def reset_function(self, index: int, tool: str) -> None:
        self.index, self.tool = index, tool
        self.function_open, self.parameters, self.parameter = True, 0, None


def _parse_block_json(block: str) -> tuple[str, str] | None:
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], _json(arguments)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _parse_block_xml(block: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """A whole XML block (for a Hermes-template model that answered in XML)."""
    match = _XML_FUNCTION.match(block)
    if match is None:
        return None
    name = match.group(1).strip()
    properties = schemas.get(name, {})
    arguments = {
        m.group(1).strip(): _typed_value(m.group(2), properties.get(m.group(1).strip()))
        for m in _XML_PARAMETER.finditer(match.group(2))
    }
    return name, _json(arguments)
