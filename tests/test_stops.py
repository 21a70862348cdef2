"""qk.stops: stop strings matched across arbitrary piece boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from qk.stops import StopMatcher


def stream(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    shown = []
    for piece in pieces:
        out = matcher.push(piece)
        shown.append(out.text)
        if out.stop is not None:
            return "".join(shown), out.stop
    shown.append(matcher.flush())
    return "".join(shown), None


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The non-streamed answer: cut where the first stop string to complete (reading left to
    right) begins; of two completing at the same character, the longer."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    _, at, stop = min(hits)
    return text[:at], stop


def test_stop_straddling_pieces() -> None:
    matcher = StopMatcher(["\nUser:"])
    assert matcher.push("Hello\nUs").text == "Hello"
    assert matcher.held == "\nUs"
    out = matcher.push("er: more")
    assert out.text == "" and out.stop == "\nUser:"
    # After the stop nothing more comes out.
    assert matcher.push("anything").text == "" and matcher.flush() == ""


def test_false_start_is_released() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("a #").text == "a "
    assert matcher.push("#").text == ""  # "##" could still become "###"
    assert matcher.held == "##"
    assert matcher.push(" c").text == "## c"
    assert matcher.flush() == ""


def test_first_completed_stop_wins() -> None:
    assert stream(StopMatcher(["bc", "abcd"]), ["xabcd"]) == ("xa", "bc")
    assert stream(StopMatcher(["bc", "abc"]), ["xabc"]) == ("x", "abc")
    # The same when the text arrives split: "c" completes before "c\n" can.
    assert stream(StopMatcher(["c\n", "c"]), ["ab", "c\n"]) == stream(
        StopMatcher(["c\n", "c"]), ["abc", "\n"]
    )


def test_no_stops_and_empty_stops() -> None:
    assert stream(StopMatcher([]), ["a", "b"]) == ("ab", None)
    assert stream(StopMatcher([""]), ["a", "b"]) == ("ab", None)
    assert stream(StopMatcher(["zz"]), ["a", "z"]) == ("az", None)  # held "z" is released at the end


@settings(max_examples=300)
@given(
    text=st.text(alphabet="ab\nc", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_split_matches_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert stream(StopMatcher(stops), pieces) == reference(text, stops)
