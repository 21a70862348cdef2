"""Every error the HTTP layer can answer, mapped from exception CLASS to status and error type in one
table (docs/architecture.md "Errors"; never from message text), and rendered in each API's own shape:
Anthropic ``{"type":"error","error":{type,message}}``, OpenAI ``{"error":{message,type,param,code}}``,
llama.cpp ``{"error":{code,message,type}}``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from qk.chat import ChatTemplateError
from qk.sampler import SamplerError
from qk.scheduler import (
    DeviceUnavailableError,
    EmptyPromptError,
    PromptTooLongError,
    QueueFullError,
    ShuttingDownError,
)

__all__ = ["ApiStyle", "AuthError", "ErrorInfo", "NotFoundError", "RequestError", "error_body", "lookup"]

log = logging.getLogger("qk.server")


class RequestError(ValueError):
    """The request is malformed: a wrong type, a missing field, a value out of range."""


class UnsupportedContentError(RequestError):
    """Content the model cannot take (images, documents: the model is text-only)."""


class AuthError(Exception):
    """Missing or wrong API key."""


class NotFoundError(Exception):
    """No such route or object."""


class ApiStyle(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"
    LLAMACPP = "llamacpp"


@dataclass(frozen=True)
class ErrorInfo:
    status: int
    anthropic_type: str
    openai_status: int
    openai_type: str
    #: Whether the message may be shown to the client (internal errors are logged, not leaked).
    expose: bool = True


def _native_classes() -> dict[type[BaseException], ErrorInfo]:
    # The engine's exception tree lives in the native module; a server built without it (tests of
    # the pure-Python layer) simply has no engine errors to map.
    try:
        from qk import _qk
    except ImportError:
        return {}
    return {
        _qk.DeviceLostError: ErrorInfo(503, "api_error", 503, "server_error"),
        _qk.OutOfMemoryError: ErrorInfo(503, "overloaded_error", 503, "server_error"),
        # A pipeline stage is unreachable or failed mid-call: the head is fine and retries the chain.
        _qk.TransportError: ErrorInfo(503, "api_error", 503, "server_error"),
        _qk.QkError: ErrorInfo(500, "api_error", 500, "server_error", expose=False),
    }


#: Exception class → how it is answered; the most derived matching class wins (MRO order).
ERROR_TABLE: dict[type[BaseException], ErrorInfo] = {
    PromptTooLongError: ErrorInfo(400, "invalid_request_error", 400, "invalid_request_error"),
    EmptyPromptError: ErrorInfo(400, "invalid_request_error", 400, "invalid_request_error"),
    RequestError: ErrorInfo(400, "invalid_request_error", 400, "invalid_request_error"),
    ChatTemplateError: ErrorInfo(400, "invalid_request_error", 400, "invalid_request_error"),
    AuthError: ErrorInfo(401, "authentication_error", 401, "authentication_error"),
    NotFoundError: ErrorInfo(404, "not_found_error", 404, "not_found_error"),
    QueueFullError: ErrorInfo(529, "overloaded_error", 429, "rate_limit_exceeded"),
    ShuttingDownError: ErrorInfo(503, "overloaded_error", 503, "server_error"),
    DeviceUnavailableError: ErrorInfo(503, "api_error", 503, "server_error"),
    SamplerError: ErrorInfo(500, "api_error", 500, "server_error"),
    **_native_classes(),
}
INTERNAL = ErrorInfo(500, "api_error", 500, "server_error", expose=False)


def lookup(exc: BaseException) -> ErrorInfo:
    for cls in type(exc).__mro__:
        info = ERROR_TABLE.get(cls)
        if info is not None:
            return info
    return INTERNAL


def error_body(exc: BaseException, style: ApiStyle) -> tuple[int, dict[str, Any]]:
    """The status and JSON body answering ``exc`` in ``style``."""
    info = lookup(exc)
    if info.expose:
        message = str(exc) or type(exc).__name__
    else:
        log.error("internal error answered as %d", info.status, exc_info=exc)
        message = "internal server error"
    if style is ApiStyle.ANTHROPIC:
        return info.status, {"type": "error", "error": {"type": info.anthropic_type, "message": message}}
    if style is ApiStyle.OPENAI:
        return info.openai_status, {
            "error": {"message": message, "type": info.openai_type, "param": None, "code": None}
        }
    return info.openai_status, {
        "error": {"code": info.openai_status, "message": message, "type": info.openai_type}
    }
