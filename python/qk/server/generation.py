"""What every API adapter shares: the ``Adapter`` shape the one generation route drives, the served
model (tokenizer, template, scheduler), prompt preparation (chat rendering, forced tool calls, the
context bound checked before tokenising) and the token → text → events pipeline of one request
(incremental detokenisation, stop strings, reasoning/tool-call parsing, disconnect checks).

The adapters only translate: request JSON → ``Prepared``; ``Output`` events → their wire format.
Streamed and non-streamed answers come from the same event sequence, so they cannot differ.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qk.chat import ChatTemplate
from qk.driver import Driver
from qk.reuse import normalise_billing_header
from qk.sampler import SamplingParams, resolve_temperature
from qk.scheduler import Failed, Finished, GenerationRequest, Job, PromptTooLongError, Scheduler, Token
from qk.server.errors import ApiStyle, RequestError
from qk.stops import StopMatcher
from qk.tokenizer import Tokenizer
from qk.toolcalls import Event, ReplyParser, TextDelta, ToolCallEnd, ToolFormat

__all__ = [
    "Adapter",
    "Done",
    "Keepalive",
    "Loaded",
    "Prepared",
    "ServedModel",
    "forced_tool_prefix",
    "generate",
    "submit",
]

log = logging.getLogger("qk.server")


@dataclass
class Loaded:
    """What loading produces (on the engine thread): the driver and the model's tokenizer."""

    driver: Driver
    tokenizer: Tokenizer
    name: str
    path: str | None = None


class ServedModel:
    """The model behind the routes; tokenizer and template exist once loading is done."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.loaded: Loaded | None = None
        self.template: ChatTemplate | None = None
        self.started_at = time.time()

    def attach(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.template = ChatTemplate.from_tokenizer(loaded.tokenizer)
        tok = loaded.tokenizer
        #: Bytes of the longest token's text: a text of n characters is at least n / this many
        #: tokens, which bounds a prompt before it is tokenised.
        self.longest_token = max(len(tok.token_to_piece(i, special=True)) for i in range(tok.vocab_size)) or 1

    def check_fits(self, chars: int, ids: int = 0) -> None:
        """Refuse a prompt of ``chars`` characters of text and ``ids`` token ids that cannot fit
        the context, from its length alone: tokenising it would hold a preparation thread, and
        build an id list, far past anything the engine could take."""
        limit = self.scheduler.ctx - 1
        at_least = ids + -(-chars // self.longest_token)
        if at_least > limit:
            raise PromptFarTooLongError(at_least, limit)

    def encode(self, text: str) -> list[int]:
        """A rendered prompt's ids (special-token spellings matched), once it is known to fit."""
        self.check_fits(len(text))
        return self.tokenizer.encode(text, special=True)

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.loaded is not None
        return self.loaded.tokenizer

    @property
    def name(self) -> str:
        return self.loaded.name if self.loaded else "loading"


class PromptFarTooLongError(PromptTooLongError):
    """A prompt refused before tokenising: its token count is only known from below."""

    def __init__(self, at_least: int, maximum: int) -> None:
        ValueError.__init__(self, f"prompt is too long: at least {at_least} tokens > {maximum} maximum")
        self.n_tokens = at_least
        self.maximum = maximum


def sampling_params(
    temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None
) -> SamplingParams:
    """The policy in one place: temperature per ``resolve_temperature``; no seed → a fresh one
    (logged by the scheduler with the slot, so a sampled answer can be replayed)."""
    return SamplingParams(
        temperature=resolve_temperature(temperature),
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None else top_k,
        seed=int.from_bytes(os.urandom(8), "little") if seed is None else seed,
    )


def forced_tool_prefix(tool_format: ToolFormat, name: str | None) -> str:
    """The start of a tool call in the template's own syntax (and the tool's name, when one is
    forced): appended to the prompt, the model can only continue with a call."""
    if tool_format is ToolFormat.HERMES:
        return '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name else "")
    if tool_format is ToolFormat.QWEN_XML:
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
    raise RequestError("this model's chat template has no tool-call syntax, so a tool call cannot be forced")


@dataclass
class Prepared:
    prompt: list[int]
    max_tokens: int | None
    params: SamplingParams
    stop_strings: list[str] = field(default_factory=list)
    #: Parses the reply into text / reasoning / tool calls; None gives raw text (/completion).
    parser: ReplyParser | None = None
    #: Text the prompt already holds of the reply (a forced tool-call prefix): parsed, not shown.
    forced_text: str = ""
    ignore_eos: bool = False
    #: Prompt tokens the next turn's prompt will start with (snapshotted for reuse); 0: none.
    history: int = 0
    #: False: prefill the whole prompt even where a saved state covers part of it.
    use_cache: bool = True
    #: End the reply after its first complete tool call (Anthropic ``disable_parallel_tool_use``,
    #: OpenAI ``parallel_tool_calls: false``).
    single_tool_call: bool = False
    #: Answer as server-sent events.
    stream: bool = False
    #: OpenAI ``stream_options.include_usage``: a final chunk with the token counts.
    stream_usage: bool = False


@dataclass(frozen=True)
class Keepalive:
    """No token for a while (a long prefill): streams send a ping."""


@dataclass(frozen=True)
class Done:
    #: "stop" (end of generation token), "length", "stop_sequence".
    reason: str
    stop_sequence: str | None
    prompt_tokens: int
    output_tokens: int
    output_ids: list[int]
    prompt_ms: float
    decode_ms: float
    #: Prompt tokens restored from a saved state instead of prefilled (cross-turn reuse).
    cached_tokens: int = 0


Output = Event | Keepalive | Done


@dataclass(frozen=True)
class Adapter:
    """One API's side of a generation route (``routes.py`` drives every API the same way: parse,
    prepare off the event loop, generate, render). ``prepare`` turns the request JSON into a
    ``Prepared`` — validation, chat rendering, tokenising — on a preparation thread, never on the
    event loop; ``collect`` folds the outputs into the non-streamed reply; ``stream`` turns them
    into SSE bytes; ``sse_error`` frames the error body of a failure once the stream has begun."""

    style: ApiStyle
    prepare: Callable[[ServedModel, dict[str, Any]], Prepared]
    collect: Callable[[ServedModel, Prepared, AsyncIterator[Output]], Awaitable[dict[str, Any]]]
    stream: Callable[[ServedModel, Prepared, AsyncIterator[Output]], AsyncIterator[bytes]]
    sse_error: Callable[[dict[str, Any]], bytes]


def sse_data(payload: str) -> bytes:
    """One ``data:`` event (OpenAI, llama.cpp); an empty payload is a keep-alive comment."""
    return f"data: {payload}\n\n".encode() if payload else b": keep-alive\n\n"


def sse_data_error(body: dict[str, Any]) -> bytes:
    """An error body as a ``data:`` event (OpenAI, llama.cpp)."""
    return sse_data(json.dumps(body))


def submit(model: ServedModel, prepared: Prepared) -> Job:
    """Queue the request: raises at once (before any response header) what cannot run (queue
    full, prompt too long, engine unavailable)."""
    stop_ids = frozenset() if prepared.ignore_eos else model.tokenizer.eog_ids
    return model.scheduler.submit(
        GenerationRequest(
            prepared.prompt,
            prepared.max_tokens,
            prepared.params,
            stop_ids,
            history=prepared.history,
            use_cache=prepared.use_cache,
        )
    )


async def generate(
    model: ServedModel,
    prepared: Prepared,
    job: Job,
    is_disconnected: Callable[[], Awaitable[bool]],
    keepalive_s: float | None = None,
) -> AsyncIterator[Output]:
    """Run one submitted request: yields parser events (or ``TextDelta`` without a parser),
    ``Keepalive`` while nothing arrives for ``keepalive_s``, and finally one ``Done``. Raises an
    engine failure as its exception. Frees the slot on any exit (client gone, stop string, error)."""
    scheduler = model.scheduler
    tokenizer = model.tokenizer
    decoder = tokenizer.incremental_decoder(special=True)
    matcher = StopMatcher(prepared.stop_strings)
    parser = prepared.parser
    output_ids: list[int] = []
    stop_sequence: str | None = None

    def parse(text: str) -> Sequence[Event]:
        if not text:
            return []
        return parser.feed(text) if parser is not None else [TextDelta(text)]

    try:
        if parser is not None and prepared.forced_text:
            for event in parser.feed(prepared.forced_text):
                yield event
        reason = "length"
        tool_done = False
        while True:
            event = await job.next_event(keepalive_s)
            if await is_disconnected():
                log.info("job %d: client disconnected, slot freed", job.id)
                return
            if event is None:
                yield Keepalive()
                continue
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                reason = event.reason
                break
            assert isinstance(event, Token)
            output_ids.append(event.id)
            match = matcher.push(decoder.push(event.id))
            for out in parse(match.text):
                if tool_done:
                    break
                yield out
                tool_done = prepared.single_tool_call and isinstance(out, ToolCallEnd)
            if tool_done:
                # One tool call was asked for: what the model writes after it is not the reply.
                reason = "stop"
                job.cancel()
                scheduler.wake()
                break
            if match.stop is not None:
                stop_sequence = match.stop
                reason = "stop_sequence"
                job.cancel()
                scheduler.wake()
                break
        if stop_sequence is None and not tool_done:
            for out in parse(matcher.push(decoder.flush()).text):
                yield out
            match_tail = matcher.flush()
            for out in parse(match_tail):
                yield out
        if parser is not None and not tool_done:
            for out in parser.finish():
                yield out
        prompt_ms = decode_ms = 0.0
        if job.prefill_started_at is not None and job.prefill_done_at is not None:
            prompt_ms = (job.prefill_done_at - job.prefill_started_at) * 1000
            decode_ms = ((job.finished_at or time.monotonic()) - job.prefill_done_at) * 1000
        yield Done(
            reason=reason,
            stop_sequence=stop_sequence,
            prompt_tokens=len(prepared.prompt),
            output_tokens=len(output_ids),
            output_ids=output_ids,
            prompt_ms=prompt_ms,
            decode_ms=decode_ms,
            cached_tokens=job.cached,
        )
    finally:
        if not job.done:
            job.cancel()
            scheduler.wake()


def tool_definitions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic tool definitions in the OpenAI shape chat templates expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {"type": "object"}),
            },
        }
        for t in tools
    ]


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    parser: ReplyParser
    forced_text: str
    #: Length of the longest prefix of ``ids`` that the conversation's next turn will also render.
    history: int = 0

    def prepared(
        self,
        max_tokens: int | None,
        params: SamplingParams,
        stops: list[str],
        *,
        single_tool_call: bool,
        stream: bool,
        stream_usage: bool = False,
    ) -> Prepared:
        """The request to run: this prompt with the API's limits, sampling and stop strings."""
        return Prepared(
            self.ids,
            max_tokens,
            params,
            stops,
            self.parser,
            self.forced_text,
            history=self.history,
            single_tool_call=single_tool_call,
            stream=stream,
            stream_usage=stream_usage,
        )


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    """A system message with Claude Code's per-request billing stamp fixed (qk.reuse)."""
    if message.get("role") != "system":
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": normalise_billing_header(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": normalise_billing_header(p["text"])}
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render_chat(
    model: ServedModel,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: str,
    tool_name: str | None,
    enable_thinking: bool | None,
    new_call_id: Callable[[], str],
) -> ChatPrompt:
    """Render an OpenAI-shaped conversation for generation.

    ``tool_choice``: "auto"; "none" leaves the tools out of the prompt (and tool tags in the reply
    stay text); "required" (Anthropic "any") or a named tool forces the reply to open with the
    template's tool-call prefix (and the name), with thinking off so the call comes first.
    """
    template = model.template
    assert template is not None
    if tool_name is not None and tools is not None:
        known = {t["function"]["name"] for t in tools}
        if tool_name not in known:
            raise RequestError(f"tool_choice names {tool_name!r}, which is not among the tools")
    forced = tool_choice == "required" or tool_name is not None
    if forced and not tools:
        raise RequestError("tool_choice forces a tool call but no tools were given")
    prompt_tools = tools if tools and tool_choice != "none" else None
    messages = [_normalised(m) for m in messages]
    last = messages[-1] if messages else {}
    if (
        last.get("role") == "assistant"
        and not str(last.get("content") or "").strip()
        and not last.get("tool_calls")
    ):
        # An empty assistant turn at the end prefills nothing: answer as if it were absent.
        messages = messages[:-1]
    continue_final = bool(messages) and messages[-1].get("role") == "assistant" and not forced
    if forced and template.supports_thinking:
        enable_thinking = False
    rendered = template.render(
        messages,
        tools=prompt_tools,
        enable_thinking=enable_thinking,
        continue_final_message=continue_final,
    )
    forced_text = forced_tool_prefix(rendered.tool_format, tool_name) if forced else ""
    text = rendered.text + forced_text
    parser = ReplyParser(
        rendered.tool_format,
        tools=prompt_tools or [],
        starts_in_reasoning=rendered.starts_in_reasoning and not forced,
        new_call_id=new_call_id,
    )
    ids = model.encode(text)
    # The conversation without the new assistant cue is what the next turn's prompt starts with
    # (up to templates that rewrite earlier turns; reuse verifies tokens, so that only costs a miss).
    history = template.render(
        messages, tools=prompt_tools, enable_thinking=enable_thinking, add_generation_prompt=False
    )
    history_ids = model.encode(history.text)
    return ChatPrompt(ids, parser, forced_text, _common_prefix(ids, history_ids))
