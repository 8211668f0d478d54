"""create_app(settings): routers, middleware, error handlers, the reconciler's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.deps import UNAUTHORIZED, token_ok
from api.routes import cluster, code, health, jobs, ui
from service import ledger
from service.admission import CodeOff, Rejected
from service.gateway import Gateway, GatewayError, RayGateway
from service.jobs import NotRunning, RunDirTaken, StillActive
from service.lifecycle import IllegalTransition
from service.metrics import ServiceMetrics
from service.reconciler import Reconciler
from service.settings import Settings, ensure_token

log = logging.getLogger("etrain.api")
CAPACITY_TTL_S = 10.0


class BodyLimit:
    """413 for bodies over the limit, counted as they arrive (Content-Length may be absent).
    Paths in `own_limit` count their bodies themselves (code archives: larger, streamed to disk)."""

    def __init__(self, app, max_bytes: int, own_limit: tuple[str, ...] = ()):
        self.app, self.max_bytes, self.own_limit = app, max_bytes, own_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].rstrip("/") in self.own_limit:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(self.max_bytes, send)
        # Read the whole body before the app sees it: an error raised while the app reads it
        # itself becomes the app's own answer (FastAPI: 400 "error parsing the body"), not a 413.
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see that
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await _too_large(self.max_bytes, send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


class BearerAuth:
    """401 for a /v1 request without the token, before anything reads its body: FastAPI
    parses a body before it runs dependencies, so a stranger's malformed body got 422 and
    an oversized one 413. Outermost, so it answers before BodyLimit too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            authorization = next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"authorization"),
                                 None)
            if not token_ok(authorization, scope["app"].state.token):
                response = JSONResponse({"detail": UNAUTHORIZED}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class TimeRequests:
    """etrain_http_request_seconds by method, route and status: the time until the response
    starts. Plain ASGI: Starlette's BaseHTTPMiddleware (@app.middleware) costs a task group and
    a memory stream on every request, several times what the rest of a job view costs."""

    def __init__(self, app, histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed(message):
            if message["type"] == "http.response.start":
                route = getattr(scope.get("route"), "path", "unmatched")  # the router put it in the scope
                self.histogram.labels(scope["method"], route, str(message["status"])).observe(
                    time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, timed)


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


async def _too_large(limit: int, send) -> None:
    response = JSONResponse({"detail": f"request body over {limit} bytes"}, status_code=413)
    await response({"type": "http"}, None, send)


def _validation_message(errors) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts)


def _capacity_probe(gateway: Gateway):
    cache: dict[str, object] = {"at": 0.0, "value": None}

    def capacity():
        # Cached: admission asks on every POST, and the answer changes slowly.
        if time.monotonic() - cache["at"] > CAPACITY_TTL_S:
            try:
                cache["value"] = gateway.cluster()
            except Exception:  # Ray down: admit, the job waits QUEUED
                cache["value"] = None
            cache["at"] = time.monotonic()
        return cache["value"]

    return capacity


def create_app(settings: Settings, gateway: Gateway | None = None, *, reconcile: bool = True) -> FastAPI:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    sessions = ledger.open_ledger(settings.db_url)
    gateway = gateway or RayGateway(settings)
    metrics = ServiceMetrics(lambda: ledger.count_by_state(sessions))
    reconciler = Reconciler(sessions, settings, gateway, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(reconciler.run_forever()) if reconcile else None
        try:
            yield
        finally:
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # docs_url/redoc_url off: api.routes.ui serves /docs from vendored files, so it works offline
    app = FastAPI(title="elastic-train", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Submit and watch distributed PyTorch training jobs on Ray.")
    app.state.settings = settings
    app.state.token, _ = ensure_token(settings)
    app.state.ledger = sessions
    app.state.gateway = gateway
    app.state.metrics = metrics
    app.state.reconciler = reconciler
    app.state.reconciling = reconcile
    app.state.capacity = _capacity_probe(gateway)
    for router in (jobs.router, code.router, cluster.router, health.router, ui.router):
        app.include_router(router)
    app.mount("/static", ui.static_files(), name="static")

    app.add_middleware(TimeRequests, histogram=metrics.request_seconds)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, own_limit=(code.router.prefix,))
    app.add_middleware(BearerAuth)  # added last: the outermost, so the first to answer
    _error_handlers(app)
    return app


def _error_handlers(app: FastAPI) -> None:
    def reply(code: int, detail, message: str | None = None) -> JSONResponse:
        body = {"detail": detail}
        if message:
            body["message"] = message
        return JSONResponse(jsonable_encoder(body), status_code=code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return reply(422, errors, _validation_message(errors))

    @app.exception_handler(Rejected)
    async def rejected(_: Request, exc: Rejected):
        return reply(422, [{"loc": list(exc.loc), "msg": exc.message, "type": "rejected"}],
                     f"{'.'.join(exc.loc[1:])}: {exc.message}")

    @app.exception_handler(CodeOff)
    async def code_off(_: Request, exc: CodeOff):
        return reply(403, str(exc))

    @app.exception_handler(IllegalTransition)
    async def illegal(_: Request, exc: IllegalTransition):
        return reply(409, str(exc))

    @app.exception_handler(ledger.DuplicateJob)
    @app.exception_handler(ledger.KeyReused)
    @app.exception_handler(NotRunning)
    @app.exception_handler(RunDirTaken)
    @app.exception_handler(StillActive)
    async def conflict(_: Request, exc: Exception):
        return reply(409, str(exc))

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError):
        return reply(422, str(exc))

    @app.exception_handler(GatewayError)
    async def ray_down(_: Request, exc: GatewayError):
        return reply(503, f"Ray is unavailable: {exc}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # Never a traceback in a response: it goes to the log.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return reply(500, "internal error; see the service log")
