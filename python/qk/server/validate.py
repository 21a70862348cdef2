"""Typed reads of JSON request fields: unknown fields are ignored, a wrong type or an out-of-range
value raises ``RequestError`` (HTTP 400) naming the field. Booleans are never numbers here, as in
JSON Schema."""

from __future__ import annotations

import json
import math
from typing import Any

from qk.server.errors import RequestError

__all__ = ["MISSING", "number", "integer", "boolean", "string", "array", "obj", "parse_body"]

MISSING: Any = object()
#: Largest request body read (a 32k-token prompt is ~130 kB of text; agents send far more JSON).
MAX_BODY_BYTES = 32 << 20


def parse_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"request body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
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
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{where}{key}: expected a number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{where}{key}: {value} is outside [{lo}, {hi}]")
    return float(value)


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
    hi: int | None = None,
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
        raise RequestError(f"{where}{key}: {value} is outside [{lo}, {hi}]")
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
    value = integer(body, key)
    if value is None or value < 0:
        return None
    return value & ((1 << 64) - 1)
