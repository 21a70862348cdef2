"""The HTTP routes: one generation route, driven by an API adapter (parse → prepare off the event loop
→ generate → render), token counting, and the introspection routes (/health, /metrics, /v1/models,
/props, /slots).

Request preparation — JSON parsing, validation, chat rendering, tokenising — runs on the
preparation threads (``Limits.prepare_threads``), never on the event loop, so one client's body
never stalls /health, another request or a running stream. Errors are rendered by exception class
in the route's API shape (``errors.py``), so no request ends in a bare 500 page or a dropped
connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qk.driver import Health
from qk.scheduler import DeviceUnavailableError, Scheduler, ShuttingDownError
from qk.server import anthropic, llamacpp, openai
from qk.server.errors import ApiStyle, NotFoundError, error_body
from qk.server.generation import Adapter, ServedModel, generate, submit
from qk.server.metrics import Metrics
from qk.server.validate import Limits, parse_body

__all__ = ["Service", "error_response", "routes"]

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


def error_response(exc: BaseException, style: ApiStyle) -> JSONResponse:
    status, body = error_body(exc, style)
    headers = {"x-should-retry": "true"} if status in (429, 503, 529) else {}
    return JSONResponse(body, status_code=status, headers=headers)


def endpoint(style: ApiStyle) -> Callable[[Handler], Handler]:
    """A handler whose failures are answered in ``style``'s error shape."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ConnectionAbortedError:
                return Response(status_code=499)
            except Exception as exc:
                return error_response(exc, style)

        return run

    return wrap


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


class Service:
    """What the routes share: the scheduler and served model, metrics, the bounds, and the
    preparation threads (started with the app, shut down with it)."""

    def __init__(
        self,
        scheduler: Scheduler,
        served: ServedModel,
        metrics: Metrics,
        limits: Limits,
        *,
        slots: int,
        ctx: int,
        keepalive_s: float,
    ) -> None:
        self.scheduler = scheduler
        self.served = served
        self.metrics = metrics
        self.limits = limits
        self.slots = slots
        self.ctx = ctx
        self.keepalive_s = keepalive_s
        self.pool = ThreadPoolExecutor(max_workers=limits.prepare_threads, thread_name_prefix="qk-prepare")

    def ready_model(self) -> ServedModel:
        if not self.scheduler.ready:
            # Raises the class that says why (loading, failed, device lost, draining).
            if self.scheduler.state == "ready":
                raise ShuttingDownError("the server is shutting down")
            raise DeviceUnavailableError(self.scheduler.unavailable_reason())
        return self.served

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a preparation thread (the event loop keeps serving meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


def generation_route(service: Service, adapter: Adapter) -> Handler:
    """The one generation route: every API runs it, differing only in its adapter."""

    def prepare(model: ServedModel, raw: bytes) -> Any:
        return adapter.prepare(model, parse_body(raw, service.limits))

    @endpoint(adapter.style)
    async def route(request: Request) -> Response:
        raw = await request.body()
        model = service.ready_model()
        prepared = await service.off_loop(prepare, model, raw)
        job = submit(model, prepared)
        outputs = generate(model, prepared, job, request.is_disconnected, service.keepalive_s)
        if not prepared.stream:
            return JSONResponse(await adapter.collect(model, prepared, outputs))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in adapter.stream(model, prepared, outputs):
                    yield chunk
            except Exception as exc:
                yield adapter.sse_error(error_body(exc, adapter.style)[1])

        return sse_response(events())

    return route


def count_tokens_route(service: Service) -> Handler:
    @endpoint(ApiStyle.ANTHROPIC)
    async def route(request: Request) -> Response:
        raw = await request.body()
        model = service.ready_model()
        counted = await service.off_loop(
            lambda: anthropic.count_tokens(model, parse_body(raw, service.limits))
        )
        return JSONResponse(counted)

    return route


class Introspection:
    """/health, /metrics, /v1/models, /props, /slots: read the server's state, never wait for the
    engine or the chain."""

    def __init__(self, service: Service) -> None:
        self.s = service

    async def health(self, request: Request) -> Response:
        # A split head also reports each stage: healthy only while the whole chain is reachable.
        scheduler = self.s.scheduler
        health = scheduler.driver.health() if scheduler.driver is not None else Health()
        extra: dict[str, Any] = {}
        if health.chain is not None:
            extra = {"stages": [dict(s) for s in health.stages], "chain": dict(health.chain)}
        if scheduler.ready and health.problem is None:
            return JSONResponse({"status": "ok", **extra})
        if scheduler.state == "loading":
            message = "Loading model"
        elif scheduler.ready:
            message = health.problem or "the driver cannot serve"
        else:
            message = scheduler.unavailable_reason() if scheduler.state != "ready" else "Shutting down"
        body = {"error": {"code": 503, "message": message, "type": "unavailable_error"}, **extra}
        return JSONResponse(body, 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_info(self) -> dict[str, Any]:
        served = self.s.served
        created = datetime.fromtimestamp(served.started_at, tz=timezone.utc)
        return {
            "type": "model",
            "id": served.name,
            "display_name": served.name,
            "created_at": created.isoformat().replace("+00:00", "Z"),
            "object": "model",
            "created": int(served.started_at),
            "owned_by": "qk",
            "max_input_tokens": self.s.ctx - 1,
            "max_tokens": self.s.ctx - 1,
        }

    async def models(self, request: Request) -> Response:
        self.s.ready_model()
        info = self.model_info()
        return JSONResponse(
            {
                "object": "list",
                "data": [info],
                "has_more": False,
                "first_id": info["id"],
                "last_id": info["id"],
            }
        )

    async def model_by_id(self, request: Request) -> Response:
        self.s.ready_model()
        if request.path_params["model_id"] != self.s.served.name:
            raise NotFoundError(f"model {request.path_params['model_id']!r} is not served here")
        return JSONResponse(self.model_info())

    async def props(self, request: Request) -> Response:
        model = self.s.ready_model()
        loaded = model.loaded
        assert loaded is not None and model.template is not None
        return JSONResponse(
            {
                "default_generation_settings": {
                    "n_ctx": self.s.ctx,
                    "params": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
                },
                "total_slots": self.s.slots,
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

    async def slots(self, request: Request) -> Response:
        now = time.monotonic()
        out = []
        for i, job in enumerate(self.s.scheduler.slot_jobs()):
            entry: dict[str, Any] = {
                "id": i,
                "n_ctx": self.s.ctx,
                "is_processing": job is not None,
                "id_task": -1,
            }
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


def routes(service: Service) -> list[Route]:
    info = Introspection(service)
    messages = generation_route(service, anthropic.ADAPTER)
    completion = generation_route(service, llamacpp.ADAPTER)
    return [
        Route("/health", info.health, methods=["GET"]),
        Route("/v1/health", info.health, methods=["GET"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route("/props", endpoint(ApiStyle.LLAMACPP)(info.props), methods=["GET"]),
        Route("/slots", endpoint(ApiStyle.LLAMACPP)(info.slots), methods=["GET"]),
        Route("/v1/models", endpoint(ApiStyle.OPENAI)(info.models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", endpoint(ApiStyle.OPENAI)(info.model_by_id), methods=["GET"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens_route(service), methods=["POST"]),
        Route("/v1/chat/completions", generation_route(service, openai.ADAPTER), methods=["POST"]),
        Route("/completion", completion, methods=["POST"]),
        Route("/completions", completion, methods=["POST"]),
    ]
