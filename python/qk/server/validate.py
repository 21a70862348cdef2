"""What a request may be, in one place: the server's bounds (``Limits``: body size, JSON shape,
preparation threads, connections), the body check that runs before any other work (``parse_body``)
and typed reads of JSON fields. Unknown fields are ignored; a wrong type, an out-of-range value or a
string that is not valid Unicode raises ``RequestError`` (HTTP 400) naming the field; a body past a
size bound raises ``BodyTooLargeError`` (HTTP 413). Booleans are never numbers here, as in JSON
Schema."""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from qk.server.errors import BodyTooLargeError, RequestError

__all__ = [
    "MAX_INT",
    "MISSING",
    "Limits",
    "array",
    "boolean",
    "integer",
    "number",
    "obj",
    "parse_body",
    "string",
]

MISSING: Any = object()
#: Largest integer a count or id field takes unless it says otherwise (a C int: nothing downstream
#: has to guard against Python's unbounded ints).
MAX_INT = 2**31 - 1


@dataclass(frozen=True)
class Limits:
    """The server's bounds. Each is a ``python -m qk.serve`` flag; the README lists them."""

    #: Largest request body read. A larger Content-Length is answered 413 before the body is read,
    #: and a chunked body is cut off (413) once it passes this. A 32k-token prompt is ~130 kB of
    #: text; agents send several times that as JSON.
    max_body_bytes: int = 8 << 20
    #: Values (and keys) in a body, counted from its structure before parsing: Python's JSON parser
    #: holds the GIL for its whole run, so its cost — about a microsecond a value — is what keeps
    #: /health and running streams answering while a large body is parsed.
    max_json_values: int = 100_000
    #: Nesting of arrays and objects (tool schemas use a handful of levels).
    max_json_depth: int = 64
    #: Digits in one JSON number literal.
    max_number_digits: int = 64
    #: Requests prepared at once (parsing, chat rendering, tokenising) on worker threads, off the
    #: event loop; more wait their turn.
    prepare_threads: int = 2
    #: HTTP connections served at once (uvicorn's limit_concurrency): more are answered 503.
    max_connections: int = 512

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_values",
            "max_json_depth",
            "prepare_threads",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


# Byte tables for the structure scan (each applied with C-speed bytes methods).
_KEEP_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [0] * 256
for _b in b"[{":
    _DEPTH_STEP[_b] = 1
for _b in b"]}":
    _DEPTH_STEP[_b] = -1
_DIGITS_AS_ZERO = bytes(ord("0") if b in b"0123456789" else ord(" ") for b in range(256))
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_shape(raw: bytes, limits: Limits) -> None:
    """Bound what ``json.loads`` will build before it runs, from the body's structure alone: values
    (every value or key follows one of ``[ { , :`` outside strings, or is the root), nesting depth
    and number lengths. Only C-speed passes over the bytes; the JSON grammar itself is left to the
    parser, which stops at the first error."""
    # Once escaped backslashes, then escaped quotes, are gone, every quote opens or closes a string.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = plain.count(b'"') // 2
    if strings > limits.max_json_values:
        raise BodyTooLargeError(
            f"request body has {strings} JSON strings, more than the {limits.max_json_values} values "
            "this server parses"
        )
    outside = b"".join(plain.split(b'"')[::2])
    values = 1 + sum(outside.count(c) for c in (b",", b":", b"[", b"{"))
    if values > limits.max_json_values:
        raise BodyTooLargeError(
            f"request body has about {values} JSON values, more than the {limits.max_json_values} "
            "this server parses"
        )
    brackets = outside.translate(None, _KEEP_BRACKETS)
    if len(brackets) > 2 * values:
        raise RequestError("request body is not valid JSON: unbalanced brackets")
    depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if depth > limits.max_json_depth:
        raise RequestError(f"request body nests {depth} levels deep, more than {limits.max_json_depth}")
    if b"0" * (limits.max_number_digits + 1) in outside.translate(_DIGITS_AS_ZERO):
        raise RequestError(f"request body has a number of more than {limits.max_number_digits} digits")


def _check_strings(body: Any) -> None:
    """Every string (key or value) must be valid Unicode: JSON's ``\\ud800``-style escapes can
    spell a lone surrogate, which the tokenizer, the template and the reply encoder all refuse."""
    stack = [body]
    while stack:
        node = stack.pop()
        items: Any = node.items() if isinstance(node, dict) else ((None, v) for v in node)
        for key, value in items:
            for s in (key, value):
                if isinstance(s, str) and _SURROGATE.search(s):
                    raise RequestError(f"request body holds a lone surrogate in the string {s[:40]!r}")
            if isinstance(value, dict | list):
                stack.append(value)


def parse_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    """The request body as a JSON object, or the error that says why not — before any other work
    is spent on it. Runs on a preparation thread: the cost is bounded by ``limits``."""
    if len(raw) > limits.max_body_bytes:
        raise BodyTooLargeError(f"request body is {len(raw)} bytes, over the {limits.max_body_bytes} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not UTF-8: {exc}") from exc
    _check_shape(raw, limits)
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers past Python's digit limit.
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if b"\\ud" in raw or b"\\uD" in raw:
        _check_strings(body)
    return body


def _get(body: dict[str, Any], key: str, required: bool, where: str) -> Any:
    value = body.get(key, MISSING)
    if value is MISSING and required:
        raise RequestError(f"{where}{key}: field required")
    return value


def number(
    body: dict[str, Any],
    key: str,
    default: Any = None,
    *,
    lo: float | None = None,
    hi: float | None = None,
    required: bool = False,
    where: str = "",
) -> Any:
    value = _get(body, key, required, where)
    if value is MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{where}{key}: expected a number")
    try:
        value = float(value)
    except OverflowError:
        raise RequestError(f"{where}{key}: an integer of {value.bit_length()} bits is out of range") from None
    if not math.isfinite(value):
        raise RequestError(f"{where}{key}: expected a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{where}{key}: {value} is outside [{lo}, {hi}]")
    return value


def _present(body: dict[str, Any], key: str, required: bool, where: str) -> Any:
    """The field's value, or MISSING when it is absent or null (an error if it is required)."""
    value = _get(body, key, required, where)
    if value is None:
        if required:
            raise RequestError(f"{where}{key}: field required")
        return MISSING
    return value


def integer(
    body: dict[str, Any],
    key: str,
    default: Any = None,
    *,
    lo: int | None = None,
    hi: int | None = MAX_INT,
    required: bool = False,
    where: str = "",
) -> Any:
    value = _present(body, key, required, where)
    if value is MISSING:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{where}{key}: expected an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        shown = value if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
        raise RequestError(f"{where}{key}: {shown} is outside [{lo}, {hi}]")
    return value


def _typed(
    body: dict[str, Any], key: str, default: Any, required: bool, where: str, kind: type, noun: str
) -> Any:
    value = _present(body, key, required, where)
    if value is MISSING:
        return default
    if not isinstance(value, kind):
        raise RequestError(f"{where}{key}: expected {noun}")
    return value


def boolean(body: dict[str, Any], key: str, default: Any = None, *, where: str = "") -> Any:
    return _typed(body, key, default, False, where, bool, "a boolean")


def string(
    body: dict[str, Any], key: str, default: Any = None, *, required: bool = False, where: str = ""
) -> Any:
    return _typed(body, key, default, required, where, str, "a string")


def array(
    body: dict[str, Any], key: str, default: Any = None, *, required: bool = False, where: str = ""
) -> Any:
    return _typed(body, key, default, required, where, list, "an array")


def obj(
    body: dict[str, Any], key: str, default: Any = None, *, required: bool = False, where: str = ""
) -> Any:
    return _typed(body, key, default, required, where, dict, "an object")


def seed_value(body: dict[str, Any], key: str = "seed") -> int | None:
    """A seed: any integer (negative ones, as llama.cpp's -1, mean "pick one")."""
    value = integer(body, key, lo=None, hi=None)
    if value is None or value < 0:
        return None
    return value & ((1 << 64) - 1)
