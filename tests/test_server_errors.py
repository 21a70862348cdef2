"""The one exception-class → status table, in each API's shape (no HTTP needed)."""

from __future__ import annotations

import pytest
from qk.chat import ChatTemplateError
from qk.scheduler import DeviceUnavailableError, EmptyPromptError, PromptTooLongError, QueueFullError
from qk.server.errors import ApiStyle, AuthError, RequestError, UnsupportedContentError, error_body


@pytest.mark.parametrize(
    ("exc", "anthropic", "openai"),
    [
        (PromptTooLongError(9, 4), (400, "invalid_request_error"), (400, "invalid_request_error")),
        (EmptyPromptError("empty"), (400, "invalid_request_error"), (400, "invalid_request_error")),
        (UnsupportedContentError("image"), (400, "invalid_request_error"), (400, "invalid_request_error")),
        (ChatTemplateError("bad"), (400, "invalid_request_error"), (400, "invalid_request_error")),
        (AuthError("key"), (401, "authentication_error"), (401, "authentication_error")),
        (QueueFullError("full"), (529, "overloaded_error"), (429, "rate_limit_exceeded")),
        (DeviceUnavailableError("loading"), (503, "api_error"), (503, "server_error")),
        (RuntimeError("secret detail"), (500, "api_error"), (500, "server_error")),
    ],
)
def test_table(exc, anthropic, openai):
    status, body = error_body(exc, ApiStyle.ANTHROPIC)
    assert (status, body["error"]["type"]) == anthropic and body["type"] == "error"
    status, body = error_body(exc, ApiStyle.OPENAI)
    assert (status, body["error"]["type"]) == openai and body["error"]["param"] is None
    status, body = error_body(exc, ApiStyle.LLAMACPP)
    assert body["error"]["code"] == status == openai[0]


def test_internal_errors_do_not_leak_their_text():
    _, body = error_body(RuntimeError("secret detail"), ApiStyle.ANTHROPIC)
    assert "secret" not in body["error"]["message"]


def test_same_message_other_class_maps_by_class():
    # The message of a client error, raised as an unknown class, is still an internal error.
    status, _ = error_body(RuntimeError("prompt is too long: 9 tokens > 4 maximum"), ApiStyle.ANTHROPIC)
    assert status == 500
    assert error_body(type("Sub", (RequestError,), {})("x"), ApiStyle.OPENAI)[0] == 400


def test_native_engine_errors():
    _qk = pytest.importorskip("qk._qk")
    assert error_body(_qk.DeviceLostError("lost"), ApiStyle.ANTHROPIC)[0] == 503
    assert error_body(_qk.EngineError("bad base"), ApiStyle.ANTHROPIC)[0] == 500
