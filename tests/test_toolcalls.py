"""qk.toolcalls: Hermes and Qwen XML tool calls, reasoning, streaming ≡ non-streamed parsing, and
malformed output degrading to text."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from qk.chat import FALLBACK_TEMPLATE, ChatTemplate
from qk.toolcalls import (
    ParsedReply,
    ReasoningDelta,
    ReplyParser,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolFormat,
    detect_tool_format,
    fold_events,
    parse_reply,
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "options": {"type": "object"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
                "zip": {"type": "string"},
            },
            "required": ["city"],
        },
    },
}
# Anthropic's tool shape is accepted too.
SHELL_TOOL = {"name": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
TOOLS = [WEATHER_TOOL, SHELL_TOOL]


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def parse(
    text: str, fmt: ToolFormat, starts_in_reasoning: bool = False, tools: list | None = TOOLS
) -> ParsedReply:
    return parse_reply(
        text, fmt, tools=tools, starts_in_reasoning=starts_in_reasoning, new_call_id=counter_ids()
    )


def stream(pieces: list[str], fmt: ToolFormat, starts_in_reasoning: bool = False, tools: list | None = TOOLS):
    parser = ReplyParser(fmt, tools=tools, starts_in_reasoning=starts_in_reasoning, new_call_id=counter_ids())
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def args(reply: ParsedReply) -> list[tuple[str, object]]:
    return [(call.name, call.arguments) for call in reply.tool_calls]


@pytest.fixture(scope="module")
def templates(llama_cpp_src: Path) -> dict[str, str]:
    folder = llama_cpp_src / "models" / "templates"
    names = {
        "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
        "qwen3": "Qwen-Qwen3-0.6B.jinja",
        "qwen3.5": "Qwen3.5-4B.jinja",
        "qwen3-coder": "Qwen3-Coder.jinja",
        "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "gemma2": "google-gemma-2-2b-it.jinja",
    }
    return {key: (folder / name).read_text(encoding="utf-8") for key, name in names.items()}


def test_format_is_read_from_the_template(templates: dict[str, str]) -> None:
    assert detect_tool_format(templates["qwen2.5"]) is ToolFormat.HERMES
    assert detect_tool_format(templates["qwen3"]) is ToolFormat.HERMES
    assert detect_tool_format(templates["qwen3.5"]) is ToolFormat.QWEN_XML
    assert detect_tool_format(templates["qwen3-coder"]) is ToolFormat.QWEN_XML
    assert detect_tool_format(templates["gemma2"]) is ToolFormat.NONE
    assert detect_tool_format(None) is ToolFormat.NONE
    assert detect_tool_format(FALLBACK_TEMPLATE) is ToolFormat.HERMES


# -- Hermes JSON ------------------------------------------------------------------------------------

HERMES_TWO_CALLS = (
    "I'll check both.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "run", "arguments": {"cmd": "echo \\"}\\" </tool_call>"}}\n</tool_call>'
)


def test_hermes_calls() -> None:
    reply = parse(HERMES_TWO_CALLS, ToolFormat.HERMES)
    assert reply.content == "I'll check both."
    assert args(reply) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("run", {"cmd": 'echo "}" </tool_call>'}),
    ]
    assert [c.id for c in reply.tool_calls] == ["call_0", "call_1"]


def test_hermes_streams_arguments_before_the_call_closes() -> None:
    parser = ReplyParser(ToolFormat.HERMES, tools=TOOLS, new_call_id=counter_ids())
    head = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert head == [ToolCallStart(0, "call_0", "get_weather"), ToolCallDelta(0, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool_call>') == [ToolCallDelta(0, 'ris"}'), ToolCallEnd(0)]
    assert parser.finish() == []


def test_hermes_alternative_shapes_parse_whole() -> None:
    # Key order the streaming head does not expect, and arguments given as a JSON string.
    reply = parse(
        '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>', ToolFormat.HERMES
    )
    assert args(reply) == [("get_weather", {"city": "Oslo"})]
    reply = parse(
        '<tool_call>{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call>', ToolFormat.HERMES
    )
    assert args(reply)[0][0] == "run"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        "<tool_call>\n[1, 2, 3]\n</tool_call>",
        "<tool_call>\nnever closed",
    ],
)
def test_hermes_malformed_degrades_to_text(text: str) -> None:
    reply = parse("before " + text, ToolFormat.HERMES)
    assert reply.tool_calls == [] and reply.content == "before " + text


def test_truncated_call_ends_instead_of_swallowing_the_reply() -> None:
    reply = parse('<tool_call>\n{"name": "run", "arguments": {"cmd": 1</tool_call> after', ToolFormat.HERMES)
    assert [c.name for c in reply.tool_calls] == ["run"] and reply.tool_calls[0].arguments is None
    assert reply.content == " after"
    # Cut off by the length limit mid-arguments: the call still ends, its JSON incomplete.
    reply = parse('<tool_call>\n{"name": "run", "arguments": {"cmd": "l', ToolFormat.HERMES)
    assert reply.tool_calls[0].arguments_json == '{"cmd": "l' and reply.tool_calls[0].arguments is None


def test_without_tool_format_tags_are_text() -> None:
    reply = parse(HERMES_TWO_CALLS, ToolFormat.NONE)
    assert reply.tool_calls == [] and reply.content == HERMES_TWO_CALLS
    # A request that declared no tools gets no calls either; tools=None accepts any name.
    assert parse(HERMES_TWO_CALLS, ToolFormat.HERMES, tools=[]).tool_calls == []
    assert len(parse(HERMES_TWO_CALLS, ToolFormat.HERMES, tools=None).tool_calls) == 2


# -- Qwen XML ---------------------------------------------------------------------------------------

XML_CALL = (
    "Let me look.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\nFalse\n</parameter>\n"
    "<parameter=ratio>\n0.25\n</parameter>\n"
    '<parameter=options>\n{"units": "si", "alerts": [1, 2]}\n</parameter>\n'
    "<parameter=hours>\n[6, 12]\n</parameter>\n"
    "<parameter=note>\nnull\n</parameter>\n"
    "<parameter=zip>\n00123\n</parameter>\n"
    "<parameter=extra>\n42\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_xml_values_are_typed_by_schema() -> None:
    reply = parse(XML_CALL, ToolFormat.QWEN_XML)
    assert reply.content == "Let me look."
    assert args(reply) == [
        (
            "get_weather",
            {
                "city": "New York",
                "days": 3,
                "metric": False,
                "ratio": 0.25,
                "options": {"units": "si", "alerts": [1, 2]},
                "hours": [6, 12],
                "note": None,
                "zip": "00123",  # a string stays verbatim even when it looks like a number
                "extra": "42",  # not in the schema: left a string
            },
        )
    ]


def test_xml_string_values_are_verbatim() -> None:
    code = "def f():\n    return '<b>'\n\n"
    text = f"<tool_call>\n<function=run>\n<parameter=cmd>\n{code}\n</parameter>\n</function>\n</tool_call>"
    assert args(parse(text, ToolFormat.QWEN_XML)) == [("run", {"cmd": code})]


def test_xml_tolerates_missing_closers_and_python_literals() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n"
        "<parameter=options>\n{'a': True, 'b': None}\n</function>\n</tool_call>"
    )
    assert args(parse(text, ToolFormat.QWEN_XML)) == [
        ("get_weather", {"city": "Lima", "options": {"a": True, "b": None}})
    ]
    # Two functions in one block are two calls; a call without parameters has empty arguments.
    text = "<tool_call>\n<function=run>\n</function>\n<function=get_weather>\n</function>\n</tool_call>"
    assert args(parse(text, ToolFormat.QWEN_XML)) == [("run", {}), ("get_weather", {})]


def test_xml_streams_strings_as_they_come_and_typed_values_whole() -> None:
    parser = ReplyParser(ToolFormat.QWEN_XML, tools=TOOLS, new_call_id=counter_ids())
    assert parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar") == [
        ToolCallStart(0, "call_0", "get_weather"),
        ToolCallDelta(0, '{"city": "'),
        ToolCallDelta(0, "Par"),
    ]
    assert parser.feed("is\n</parameter>\n<parameter=days>\n2\n</param") == [ToolCallDelta(0, 'is"')]
    assert parser.feed("eter>\n</function>\n</tool_call>") == [
        ToolCallDelta(0, ', "days": 2'),
        ToolCallDelta(0, "}"),
        ToolCallEnd(0),
    ]


def test_xml_string_fragments_hold_the_closing_newline() -> None:
    parser = ReplyParser(ToolFormat.QWEN_XML, tools=TOOLS, new_call_id=counter_ids())
    parser.feed("<tool_call>\n<function=run>\n<parameter=cmd>\n")
    # The newline may be the one the format puts before </parameter>: held until text follows.
    assert parser.feed('echo "a"\n') == [ToolCallDelta(0, 'echo \\"a\\"')]
    assert parser.feed("ls\n</para") == [ToolCallDelta(0, "\\nls")]
    assert parser.feed("meter>\n</function>\n</tool_call>") == [
        ToolCallDelta(0, '"'),
        ToolCallDelta(0, "}"),
        ToolCallEnd(0),
    ]
    assert parser.result().tool_calls[0].arguments == {"cmd": 'echo "a"\nls'}


def test_xml_malformed_degrades_to_text() -> None:
    for text in (
        "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
        "<tool_call>\njust words\n</tool_call>",
    ):
        reply = parse(text, ToolFormat.QWEN_XML)
        assert reply.tool_calls == [] and reply.content == text


def test_hermes_json_under_an_xml_template_still_parses() -> None:
    text = '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'
    assert args(parse(text, ToolFormat.QWEN_XML)) == [("run", {"cmd": "ls"})]


# -- reasoning --------------------------------------------------------------------------------------


def test_reasoning_block_in_output() -> None:
    reply = parse("<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.", ToolFormat.HERMES)
    assert (reply.reasoning, reply.content) == ("Step 1.\nStep 2.", "The answer is 4.")


def test_think_tag_after_answer_text_is_text() -> None:
    text = "Wrap it in <think> tags.\n<think>x</think>"
    assert parse(text, ToolFormat.HERMES) == ParsedReply(content=text)
    # Whitespace before the block does not count as answer text.
    assert parse("\n <think>r</think>a", ToolFormat.HERMES) == ParsedReply(content="a", reasoning="r")


def test_output_that_starts_inside_reasoning() -> None:
    reply = parse("The user wants X.\n</think>\n\nX.", ToolFormat.QWEN_XML, starts_in_reasoning=True)
    assert (reply.reasoning, reply.content) == ("The user wants X.", "X.")
    # Cut off while still thinking: all of it is reasoning.
    reply = parse("Hmm, let me", ToolFormat.QWEN_XML, starts_in_reasoning=True)
    assert (reply.reasoning, reply.content) == ("Hmm, let me", "")


def test_tool_call_ends_unclosed_reasoning() -> None:
    text = "I need the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    reply = parse(text, ToolFormat.QWEN_XML, starts_in_reasoning=True)
    assert reply.reasoning == "I need the weather." and args(reply) == [("get_weather", {"city": "Rome"})]


def test_partial_markers_are_held_back() -> None:
    parser = ReplyParser(ToolFormat.HERMES, tools=TOOLS, starts_in_reasoning=True)
    assert parser.feed("thinking</thi") == [ReasoningDelta("thinking")]
    assert parser.feed("nk>\n\nAnswer <tool_ca") == [TextDelta("Answer")]
    # The held "<tool_ca" (and the space before it) come out once they cannot be a tag.
    assert parser.feed("t>") == [TextDelta(" <tool_cat>")]
    assert parser.finish() == []


# -- streaming ≡ whole --------------------------------------------------------------------------------

SAMPLES = [
    (HERMES_TWO_CALLS, ToolFormat.HERMES, False),
    (XML_CALL, ToolFormat.QWEN_XML, False),
    ("<think>\nplan\n</think>\n\n" + HERMES_TWO_CALLS + "\nDone.", ToolFormat.HERMES, False),
    ("reason </thin> more\n\n</think>\n\n" + XML_CALL, ToolFormat.QWEN_XML, True),
    ("<tool_call>\nbroken\n</tool_call> tail <tool_call", ToolFormat.HERMES, False),
    ('<tool_call>\n{"name": "run", "arguments": {"cmd": "x</tool_call>"', ToolFormat.HERMES, False),
    (
        '<tool_call>\n<function=run>\n<parameter=cmd>\n\n"quoted" </para <parameter\n\n\n</parameter>\n'
        "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=note>\nnull\n"
        "<parameter=city>\nOslo</function></tool_call>",
        ToolFormat.QWEN_XML,
        False,
    ),
    ("<tool_call>\n<function=run>\n<parameter=cmd>\nabc\n", ToolFormat.QWEN_XML, False),
]


def check_well_formed(events: list) -> None:
    open_calls: set[int] = set()
    seen: set[int] = set()
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index not in seen and event.index == len(seen)
            seen.add(event.index)
            open_calls.add(event.index)
        elif isinstance(event, ToolCallDelta | ToolCallEnd):
            assert event.index in open_calls
            if isinstance(event, ToolCallEnd):
                open_calls.remove(event.index)
        else:
            assert event.text != ""
    assert open_calls == set()


@settings(max_examples=200)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 600), max_size=30))
def test_any_split_gives_the_same_parse(sample: tuple[str, ToolFormat, bool], cuts: list[int]) -> None:
    text, fmt, in_reasoning = sample
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    events = stream(pieces, fmt, in_reasoning)
    check_well_formed(events)
    assert fold_events(events) == parse(text, fmt, in_reasoning)


FRAGMENTS = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<think>", "</think>", "<function=run>", "</function>", "<parameter=cmd>",
     "</parameter>", '{"name": "run", "arguments": ', '{"cmd": "', '"}', "}", "\n", " ", "<", "/", "text", '"']
)  # fmt: skip


@settings(max_examples=300)
@given(
    parts=st.lists(st.one_of(FRAGMENTS, st.text(max_size=4)), max_size=20),
    fmt=st.sampled_from(list(ToolFormat)),
    in_reasoning=st.booleans(),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_junk_never_raises_and_splits_agree(
    parts: list[str], fmt: ToolFormat, in_reasoning: bool, cuts: list[int]
) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    events = stream(pieces, fmt, in_reasoning)
    check_well_formed(events)
    assert fold_events(events) == parse(text, fmt, in_reasoning)


# -- round trip through the real templates ----------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "qwen3-coder", "qwen2.5"])
def test_rendered_tool_calls_parse_back(templates: dict[str, str], name: str) -> None:
    """What a template writes for an assistant's tool calls is what the parser reads back."""
    template = ChatTemplate(templates[name])
    arguments = {"city": "Zürich", "days": 2, "metric": True, "options": {"a": [1, "b"]}, "note": None}
    calls = [
        {
            "id": "x",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
        },
        {"id": "y", "type": "function", "function": {"name": "run", "arguments": {"cmd": "ls -la\n"}}},
    ]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
    ]
    prompt = template.render(messages, tools=TOOLS, add_generation_prompt=False).text
    start = prompt.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    reply_text = prompt[start : prompt.rindex("<|im_end|>")]
    reply = parse(reply_text, template.tool_format)
    assert reply.content == "Checking."
    assert args(reply) == [("get_weather", arguments), ("run", {"cmd": "ls -la\n"})]
