"""Chat prompts rendered with the model's own ``tokenizer.chat_template`` (sandboxed Jinja2).

The template text decides everything model-specific (tool prompt, tool-call syntax, thinking
scaffold); this module supplies what HF-style templates expect around it (``tojson``,
``raise_exception``, ``strftime_now``, OpenAI-shaped messages and tools) and reports what the
rendered prompt implies for parsing the reply: whether output starts inside ``<think>`` and which
tool-call format to expect. Special-token spellings inside message text (a user typing
``<|im_end|>``, a tool result quoting ``</tool_response>``) are tracked through rendering so that
they tokenise as text. A GGUF without a template gets a built-in Qwen ChatML one.

Example::

    template = ChatTemplate.from_tokenizer(tok)
    prompt = template.render([{"role": "user", "content": "Hi"}], tools=tools)
    ids = prompt.token_ids(tok)      # message text never becomes control tokens
    parser = prompt.reply_parser(tools)
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qk.toolcalls import ReplyParser, ToolFormat, detect_tool_format

if TYPE_CHECKING:
    from qk.tokenizer import Tokenizer

__all__ = [
    "FALLBACK_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "RenderedPrompt",
    "prompt_ends_in_reasoning",
]


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered: the template rejected it (``raise_exception``), or the
    template itself is broken. A client error, not a server fault, when the template rejected it."""


# Used when the GGUF carries no `tokenizer.chat_template`: ChatML turns as Qwen models are trained
# on, tools announced in the system turn and called in Hermes JSON, tool results as a user turn of
# <tool_response> blocks.
FALLBACK_TEMPLATE = """\
{%- set ns = namespace(system='') %}
{%- if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if ns.system %}{{ ns.system + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, ' }}
{{- '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif ns.system %}
{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` ends inside an open ``<think>`` block (the template opened the model's
    reasoning for it, so the reply starts as reasoning with no opening tag of its own)."""
    opened = prompt.rfind(THINK_OPEN)
    return opened >= 0 and prompt.find(THINK_CLOSE, opened) < 0


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt and what it implies for the reply."""

    text: str
    #: The prompt ends inside ``<think>``: the reply begins as reasoning.
    starts_in_reasoning: bool
    #: How the model writes tool calls (read from the template text).
    tool_format: ToolFormat
    #: Character ranges of special-token spellings that came from message text, not the template.
    literal_spans: tuple[tuple[int, int], ...] = ()

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's ids: template tokens as special tokens, message text as plain text."""
        return tokenizer.encode(self.text, special=True, literal_spans=self.literal_spans)

    def reply_parser(self, tools: Sequence[Mapping[str, Any]] | None = None) -> ReplyParser:
        """A fresh streaming parser for the model's reply to this prompt."""
        return ReplyParser(self.tool_format, tools=tools, starts_in_reasoning=self.starts_in_reasoning)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    # HF transformers' `tojson` (templates are written against it): plain json.dumps, non-ASCII kept,
    # no HTML escaping of <, >, & as Jinja's built-in filter would do.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # The settings HF transformers renders chat templates with; templates depend on trim_blocks and
    # lstrip_blocks for their whitespace.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _text_of(content: Any) -> Any:
    """Message content as templates expect it: None → "", text-only part lists → one string;
    lists holding images stay lists (vision templates iterate them)."""
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ChatTemplateError("every message must be an object with a string 'role'")
    out = dict(message)
    out["content"] = _text_of(message.get("content"))
    # Qwen templates read `reasoning_content` (llama.cpp's name); vLLM's newer name is `reasoning`.
    if out.get("reasoning_content") is None and isinstance(message.get("reasoning"), str):
        out["reasoning_content"] = message["reasoning"]
    if message.get("tool_calls"):
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
            raise ChatTemplateError("'tool_calls' must be a list of objects")
        out["tool_calls"] = [_normalise_tool_call(call) for call in calls]
    return out


def _normalise_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI tool calls carry ``arguments`` as a JSON string; templates iterate it as a mapping
    (Qwen3.5, Qwen3-Coder) or print it (Hermes), so a string holding a JSON object is parsed."""
    out = copy.deepcopy(dict(call))
    target = out.get("function") if isinstance(out.get("function"), dict) else out
    arguments = target.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"tool call arguments are not JSON: {exc}") from exc
        if not isinstance(parsed, dict):
            raise ChatTemplateError("tool call arguments must be a JSON object")
        target["arguments"] = parsed
    elif arguments is None:
        target["arguments"] = {}
    return out


def _normalise_tool(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """Tools in OpenAI's shape, the one Qwen templates print and the models were trained on;
    Anthropic's ``{name, description, input_schema}`` is converted."""
    if not isinstance(tool, Mapping):
        raise ChatTemplateError("every tool must be an object")
    if "function" in tool or "input_schema" not in tool:
        return tool
    function: dict[str, Any] = {"name": tool.get("name")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    return {"type": "function", "function": function}


class ChatTemplate:
    """A compiled chat template with the tokens and capabilities it was built with."""

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: Iterable[str] = (),
    ) -> None:
        self.source = source if source else FALLBACK_TEMPLATE
        # Spellings of special tokens to keep literal where they occur in message text (the
        # tokenizer's control and user-defined tokens); longest first so that overlaps resolve as
        # the tokenizer would.
        texts = sorted({t for t in special_tokens if t}, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.is_fallback = not source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tool_format = detect_tool_format(self.source)
        #: The template knows about reasoning blocks (`enable_thinking` may change its output).
        self.supports_thinking = THINK_OPEN in self.source
        try:
            self._template = _make_environment().from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        def text_of(token_id: int | None) -> str:
            return tokenizer.tokens[token_id] if token_id is not None else ""

        return cls(
            tokenizer.chat_template,
            bos_token=text_of(tokenizer.bos_id),
            eos_token=text_of(tokenizer.eos_id),
            special_tokens=tokenizer.special_tokens,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> RenderedPrompt:
        """Render an OpenAI-shaped conversation.

        ``messages``: ``{"role", "content", "reasoning_content"?, "tool_calls"?: [{"id",
        "type": "function", "function": {"name", "arguments"}}], "tool_call_id"?}``; ``tools``:
        ``[{"type": "function", "function": {"name", "description", "parameters"}}]`` (Anthropic's
        ``{"name", "description", "input_schema"}`` is accepted and converted).
        ``enable_thinking=None`` leaves the template's default. ``continue_final_message`` renders
        the last (assistant) message open, so generation continues it (Anthropic prefill).
        """
        if not messages:
            raise ChatTemplateError("no messages to render")
        shield = _Shield(self._special_pattern)
        normalised = shield.apply([_normalise_message(m) for m in messages])
        context: dict[str, Any] = {
            "messages": normalised,
            "tools": shield.apply([_normalise_tool(t) for t in tools]) if tools else None,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **template_kwargs,
        }
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        try:
            text = self._template.render(context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            # A template that breaks on this conversation (e.g. content of a type it cannot join).
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from exc
        if continue_final_message:
            text = self._cut_after_final_message(text, normalised[-1])
        # Judged before the message text is put back: a user's "<think>" opens nothing.
        starts_in_reasoning = prompt_ends_in_reasoning(text)
        text, spans = shield.restore(text)
        return RenderedPrompt(text, starts_in_reasoning, self.tool_format, spans)

    @staticmethod
    def _cut_after_final_message(text: str, final: Mapping[str, Any]) -> str:
        content = final.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        # Templates may trim the content; cut right after the last place its trimmed text appears.
        stripped = content.strip()
        at = text.rfind(stripped)
        if at < 0:
            raise ChatTemplateError("the template does not render the final message's text verbatim")
        return text[: at + len(stripped)]


class _Shield:
    """Swaps special-token spellings in message text for private placeholders while the template
    runs, then puts them back and reports where they are, so that they tokenise as text.

    Placeholders are private-use characters around a per-render nonce: no template logic keys on
    them, and no input can forge one.
    """

    def __init__(self, pattern: re.Pattern[str] | None) -> None:
        self._pattern = pattern
        self._nonce = uuid.uuid4().hex[:16]
        self._originals: list[str] = []
        self._placeholder = re.compile("\ue000" + self._nonce + r"(\d+)\ue001")

    def _hide(self, match: re.Match[str]) -> str:
        self._originals.append(match.group(0))
        return f"\ue000{self._nonce}{len(self._originals) - 1}\ue001"

    def apply(self, value: Any) -> Any:
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(self._hide, value)
        if isinstance(value, Mapping):
            return {key: self.apply(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.apply(item) for item in value]
        return value

    def restore(self, text: str) -> tuple[str, tuple[tuple[int, int], ...]]:
        if not self._originals:
            return text, ()
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        length = cursor = 0
        for match in self._placeholder.finditer(text):
            before = text[cursor : match.start()]
            original = self._originals[int(match.group(1))]
            pieces += [before, original]
            length += len(before)
            spans.append((length, length + len(original)))
            length += len(original)
            cursor = match.end()
        pieces.append(text[cursor:])
        return "".join(pieces), tuple(spans)
