"""Chat prompts rendered with the model's own ``tokenizer.chat_template`` (sandboxed Jinja2).

The template text decides everything model-specific (tool prompt, tool-call syntax, thinking
scaffold); this module supplies what HF-style templates expect around it (``tojson``,
``raise_exception``, ``strftime_now``, OpenAI-shaped messages and tools) and reports what the
rendered prompt implies for parsing the reply: whether output starts inside ``<think>`` and which
tool-call format to expect. A GGUF without a template gets a built-in Qwen ChatML one.

Example::

    template = ChatTemplate.from_tokenizer(tok)
    prompt = template.render([{"role": "user", "content": "Hi"}], tools=tools)
    ids = tok.encode(prompt.text, special=True)
    parser = prompt.reply_parser(tools)
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
from collections.abc import Mapping, Sequence
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
    if "role" not in message:
        raise ChatTemplateError("every message needs a 'role'")
    out = dict(message)
    out["content"] = _text_of(message.get("content"))
    # Qwen templates read `reasoning_content` (llama.cpp's name); vLLM's newer name is `reasoning`.
    if out.get("reasoning_content") is None and isinstance(message.get("reasoning"), str):
        out["reasoning_content"] = message["reasoning"]
    if message.get("tool_calls"):
        out["tool_calls"] = [_normalise_tool_call(call) for call in message["tool_calls"]]
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


class ChatTemplate:
    """A compiled chat template with the tokens and capabilities it was built with."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source if source else FALLBACK_TEMPLATE
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
            tokenizer.chat_template, bos_token=text_of(tokenizer.bos_id), eos_token=text_of(tokenizer.eos_id)
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
        ``[{"type": "function", "function": {"name", "description", "parameters"}}]``.
        ``enable_thinking=None`` leaves the template's default. ``continue_final_message`` renders
        the last (assistant) message open, so generation continues it (Anthropic prefill).
        """
        if not messages:
            raise ChatTemplateError("no messages to render")
        normalised = [_normalise_message(m) for m in messages]
        context: dict[str, Any] = {
            "messages": normalised,
            "tools": list(tools) if tools else None,
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
        return RenderedPrompt(text, prompt_ends_in_reasoning(text), self.tool_format)

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
