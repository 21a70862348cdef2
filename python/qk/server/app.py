"""The Starlette application: routes, API-key check, request ids, error rendering, lifespan.

Every engine call goes through the scheduler's engine thread (the one door, docs/architecture.md "Server layering"); handlers
only translate JSON and await events. Errors are rendered by exception class in the route's API
shape (``errors.py``), so no request ends in a bare 500 page or a dropped connection.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qk.scheduler import DeviceUnavailableError, ReuseSettings, Scheduler, ShuttingDownError
from qk.server import anthropic, llamacpp, openai
from qk.server import validate as v
from qk.server.errors import ApiStyle, AuthError, NotFoundError, error_body
from qk.server.generation import Loaded, ServedModel, generate, submit
from qk.server.metrics import Metrics

__all__ = ["create_app"]

log = logging.getLogger("qk.server")

#: Paths answered without an API key (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/health", "/v1/health"})


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


def error_response(exc: BaseException, style: ApiStyle) -> JSONResponse:
    status, body = error_body(exc, style)
    headers = {"x-should-retry": "true"} if status in (429, 503, 529) else {}
    return JSONResponse(body, status_code=status, headers=headers)


class Gate:
    """Pure ASGI middleware: request id, API key, per-route request counts."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.routes = routes

    def _authorised(self, scope: Scope) -> bool:
        if self.api_key is None or scope.get("path") in OPEN_PATHS:
            return True
        headers = {k.lower(): val for k, val in scope.get("headers") or []}
        offered = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            offered = offered or auth[7:].strip()
        return hmac.compare_digest(offered, self.api_key.encode())

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
            if not self._authorised(scope):
                response = error_response(AuthError("invalid or missing API key"), style_of(scope))
                await response(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.count_request(route, status_seen)


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
) -> Starlette:
    """The whole server. ``loader`` runs on the engine thread at start-up (``/health`` answers 503
    until it returns) and yields the driver and tokenizer. ``reuse`` bounds cross-turn state
    reuse (None: off; it is also off when the driver cannot snapshot)."""
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

    def ready_model() -> ServedModel:
        if not scheduler.ready:
            # Raises the class that says why (loading, failed, device lost, draining).
            if scheduler.state == "ready":
                raise ShuttingDownError("the server is shutting down")
            raise DeviceUnavailableError(scheduler.unavailable_reason())
        return served

    def endpoint(style: ApiStyle) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable]:
        def wrap(
            handler: Callable[[Request], Awaitable[Response]],
        ) -> Callable[[Request], Awaitable[Response]]:
            async def run(request: Request) -> Response:
                try:
                    return await handler(request)
                except ConnectionAbortedError:
                    return Response(status_code=499)
                except Exception as exc:
                    return error_response(exc, style)

            return run

        return wrap

    async def body_of(request: Request) -> dict[str, Any]:
        return v.parse_body(await request.body())

    def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
        return StreamingResponse(
            chunks,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    # -- Anthropic ----------------------------------------------------------------------------------

    @endpoint(ApiStyle.ANTHROPIC)
    async def messages(request: Request) -> Response:
        body = await body_of(request)
        model = ready_model()
        prepared = anthropic.prepare(model, body)
        job = submit(model, prepared)
        outputs = generate(model, prepared, job, request.is_disconnected, keepalive_s)
        if not body.get("stream"):
            return JSONResponse(await anthropic.collect(model, outputs, len(prepared.prompt)))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in anthropic.stream(model, outputs, len(prepared.prompt)):
                    yield anthropic.sse(event)
            except Exception as exc:
                _, err = error_body(exc, ApiStyle.ANTHROPIC)
                yield anthropic.sse(err)

        return sse_response(events())

    @endpoint(ApiStyle.ANTHROPIC)
    async def count_tokens(request: Request) -> Response:
        body = await body_of(request)
        model = ready_model()
        chat = anthropic.render(model, body)
        return JSONResponse({"input_tokens": len(chat.ids)})

    # -- OpenAI -------------------------------------------------------------------------------------

    @endpoint(ApiStyle.OPENAI)
    async def chat_completions(request: Request) -> Response:
        body = await body_of(request)
        model = ready_model()
        prepared = openai.prepare(model, body)
        with_usage = openai.include_usage(body)
        job = submit(model, prepared)
        outputs = generate(model, prepared, job, request.is_disconnected, keepalive_s)
        if not body.get("stream"):
            return JSONResponse(await openai.collect(model, outputs))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for data in openai.stream(model, outputs, with_usage):
                    yield b": keep-alive\n\n" if not data else f"data: {data}\n\n".encode()
            except Exception as exc:
                _, err = error_body(exc, ApiStyle.OPENAI)
                yield f"data: {json.dumps(err)}\n\n".encode()

        return sse_response(events())

    # -- llama.cpp ----------------------------------------------------------------------------------

    @endpoint(ApiStyle.LLAMACPP)
    async def completion(request: Request) -> Response:
        body = await body_of(request)
        model = ready_model()
        prepared = llamacpp.prepare(model, body)
        job = submit(model, prepared)
        outputs = generate(model, prepared, job, request.is_disconnected, keepalive_s)
        if not body.get("stream"):
            return JSONResponse(await llamacpp.collect(model, prepared, outputs))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for data in llamacpp.stream(model, prepared, outputs):
                    yield b": keep-alive\n\n" if not data else f"data: {data}\n\n".encode()
            except Exception as exc:
                _, err = error_body(exc, ApiStyle.LLAMACPP)
                yield f"data: {json.dumps(err)}\n\n".encode()

        return sse_response(events())

    # -- introspection ------------------------------------------------------------------------------

    async def health(request: Request) -> Response:
        # A split head also reports each stage: healthy only while the whole chain is reachable.
        stages = getattr(scheduler.driver, "stages", None)
        extra: dict[str, Any] = {}
        if stages is not None:
            extra = {"stages": stages(), "chain": scheduler.driver.chain_status()}  # type: ignore[union-attr]
        if scheduler.ready and (not extra or extra["chain"]["up"]):
            return JSONResponse({"status": "ok", **extra})
        if scheduler.state == "loading":
            message = "Loading model"
        elif scheduler.ready:
            why = extra["chain"]["last_error"] or "not connected yet"
            message = f"a pipeline stage is unreachable: {why}"
        else:
            message = scheduler.unavailable_reason() if scheduler.state != "ready" else "Shutting down"
        body = {"error": {"code": 503, "message": message, "type": "unavailable_error"}, **extra}
        return JSONResponse(body, 503)

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_info() -> dict[str, Any]:
        created = datetime.fromtimestamp(served.started_at, tz=timezone.utc)
        return {
            "type": "model",
            "id": served.name,
            "display_name": served.name,
            "created_at": created.isoformat().replace("+00:00", "Z"),
            "object": "model",
            "created": int(served.started_at),
            "owned_by": "qk",
            "max_input_tokens": ctx - 1,
            "max_tokens": ctx - 1,
        }

    @endpoint(ApiStyle.OPENAI)
    async def models(request: Request) -> Response:
        ready_model()
        info = model_info()
        return JSONResponse(
            {
                "object": "list",
                "data": [info],
                "has_more": False,
                "first_id": info["id"],
                "last_id": info["id"],
            }
        )

    @endpoint(ApiStyle.OPENAI)
    async def model_by_id(request: Request) -> Response:
        ready_model()
        if request.path_params["model_id"] != served.name:
            raise NotFoundError(f"model {request.path_params['model_id']!r} is not served here")
        return JSONResponse(model_info())

    @endpoint(ApiStyle.LLAMACPP)
    async def props(request: Request) -> Response:
        model = ready_model()
        loaded = model.loaded
        assert loaded is not None and model.template is not None
        return JSONResponse(
            {
                "default_generation_settings": {
                    "n_ctx": ctx,
                    "params": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
                },
                "total_slots": slots,
                "model_path": loaded.path,
                "model_alias": model.name,
                "chat_template": model.template.source,
                "chat_template_caps": {
                    "supports_tools": model.template.tool_format.value != "none",
                    "supports_thinking": model.template.supports_thinking,
                },
                "modalities": {"vision": False, "audio": False},
                "build_info": "qk",
                "is_sleeping": False,
            }
        )

    @endpoint(ApiStyle.LLAMACPP)
    async def slots_route(request: Request) -> Response:
        now = time.monotonic()
        out = []
        for i, job in enumerate(scheduler.slot_jobs()):
            entry: dict[str, Any] = {"id": i, "n_ctx": ctx, "is_processing": job is not None, "id_task": -1}
            if job is not None:
                p = job.request.params
                entry.update(
                    id_task=job.id,
                    params={"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed},
                    next_token={"n_decoded": job.generated},
                    n_prompt_tokens=len(job.request.prompt),
                    position=job.position,
                    seconds=round(now - job.submitted_at, 3),
                )
            out.append(entry)
        if request.query_params.get("fail_on_no_slot") == "1" and all(e["is_processing"] for e in out):
            return JSONResponse(
                {"error": {"code": 503, "message": "no slot available", "type": "unavailable_error"}}, 503
            )
        return JSONResponse(out)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots_route, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_by_id, methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/completion", completion, methods=["POST"]),
        Route("/completions", completion, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        yield
        # uvicorn has stopped accepting and waited for open responses; let stragglers finish.
        await run_in_threadpool(scheduler.drain, 60.0)

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
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed},
    )
    app.state.scheduler = scheduler
    app.state.served = served
    app.state.metrics = metrics
    known = frozenset(r.path for r in routes if "{" not in r.path)
    app.add_middleware(Gate, api_key=api_key, metrics=metrics, routes=known)
    return app
