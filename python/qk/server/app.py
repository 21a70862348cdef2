"""The Starlette application, wired: the scheduler, the served model and the routes (``routes.py``),
behind a gate that sets request ids, checks the API key, bounds the request body and counts
requests; the lifespan starts and drains the engine thread.

Every engine call goes through the scheduler's engine thread (the one door, docs/architecture.md "Server
layering").
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qk.scheduler import ReuseSettings, Scheduler
from qk.server.errors import ApiStyle, AuthError, BodyTooLargeError, NotFoundError, error_body
from qk.server.generation import Loaded, ServedModel
from qk.server.metrics import Metrics
from qk.server.routes import Service, error_response, routes
from qk.server.validate import Limits

__all__ = ["create_app"]

log = logging.getLogger("qk.server")

#: Paths answered without an API key (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/health", "/v1/health"})
#: Body bytes read and dropped after a body is refused for its size, so the client reads the 413
#: instead of a reset connection; a client still sending past this is cut off.
DRAIN_BYTES = 64 << 20


def style_of(scope: Scope) -> ApiStyle:
    path: str = scope.get("path", "")
    if path.startswith("/v1/messages"):
        return ApiStyle.ANTHROPIC
    if path.startswith("/v1/chat") or path == "/v1/completions":
        return ApiStyle.OPENAI
    headers = dict(scope.get("headers") or [])
    if b"anthropic-version" in headers:
        return ApiStyle.ANTHROPIC
    return ApiStyle.OPENAI if path.startswith("/v1/") else ApiStyle.LLAMACPP


class Gate:
    """Pure ASGI middleware: request id, API key, body size, per-route request counts."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: Metrics, routes: frozenset[str], max_body: int
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.routes = routes
        self.max_body = max_body

    def _authorised(self, scope: Scope) -> bool:
        if self.api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        headers = {k.lower(): val for k, val in scope.get("headers") or []}
        offered = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            offered = offered or auth[7:].strip()
        return hmac.compare_digest(offered, self.api_key.encode())

    def _declared_length(self, scope: Scope) -> int | None:
        for key, value in scope.get("headers") or []:
            if key.lower() == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` that raises BodyTooLargeError (HTTP 413) once the body passes the bound (a
        chunked body declares no length), after draining what the client still sends."""
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    await _drain(receive, message, seen)
                    raise BodyTooLargeError(f"request body is over the {self.max_body} bytes allowed")
            return message

        return bounded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + uuid.uuid4().hex[:24]
        path = scope.get("path", "")
        route = path if path in self.routes else "other"
        status_seen = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"request-id", request_id.encode())]
            await send(message)

        try:
            refusal: Exception | None = None
            declared = self._declared_length(scope)
            if not self._authorised(scope):
                refusal = AuthError("invalid or missing API key")
            elif declared is not None and declared > self.max_body:
                # Refused from the header: not a byte of it is parsed.
                await _drain(receive, {"more_body": True}, 0)
                refusal = BodyTooLargeError(
                    f"request body is {declared} bytes, over the {self.max_body} allowed"
                )
            if refusal is not None:
                await error_response(refusal, style_of(scope))(scope, receive, send_with_id)
                return
            await self.app(scope, self._bounded(receive), send_with_id)
        finally:
            self.metrics.count_request(route, status_seen)


async def _drain(receive: Receive, message: Message, seen: int) -> None:
    while message.get("more_body") and seen <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))


def create_app(
    loader: Callable[[], Loaded],
    *,
    slots: int,
    ctx: int,
    api_key: str | None = None,
    max_queue: int = 64,
    keepalive_s: float = 10.0,
    device_lost_errors: tuple[type[BaseException], ...] = (),
    reuse: ReuseSettings | None = None,
    limits: Limits | None = None,
) -> Starlette:
    """The whole server. ``loader`` runs on the engine thread at start-up (``/health`` answers 503
    until it returns) and yields the driver and tokenizer. ``reuse`` bounds cross-turn state
    reuse (None: off; it is also off when the driver cannot snapshot). ``limits``: the request
    bounds (``validate.Limits``; its defaults when None)."""
    limits = limits or Limits()
    lost = list(device_lost_errors)
    try:
        from qk import _qk

        lost.append(_qk.DeviceLostError)
    except ImportError:
        pass

    served: ServedModel

    def load() -> Any:
        loaded = loader()
        served.attach(loaded)
        return loaded.driver

    scheduler = Scheduler(
        load, slots=slots, ctx=ctx, max_queue=max_queue, device_lost_errors=tuple(lost), reuse=reuse
    )
    served = ServedModel(scheduler)
    metrics = Metrics(scheduler)
    service = Service(scheduler, served, metrics, limits, slots=slots, ctx=ctx, keepalive_s=keepalive_s)
    table = routes(service)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        yield
        # uvicorn has stopped accepting and waited for open responses; let stragglers finish.
        await run_in_threadpool(scheduler.drain, 60.0)
        service.pool.shutdown(wait=False, cancel_futures=True)

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(
            NotFoundError(f"no route {request.method} {request.url.path}"), style_of(request.scope)
        )

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        status, body = error_body(
            NotFoundError(f"{request.method} is not allowed on {request.url.path}"), style_of(request.scope)
        )
        return JSONResponse(body, status_code=405)

    app = Starlette(
        routes=table,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed},
    )
    app.state.scheduler = scheduler
    app.state.served = served
    app.state.metrics = metrics
    app.state.limits = limits
    known = frozenset(r.path for r in table if "{" not in r.path)
    app.add_middleware(Gate, api_key=api_key, metrics=metrics, routes=known, max_body=limits.max_body_bytes)
    return app
