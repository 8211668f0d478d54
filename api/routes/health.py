from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import GatewayDep, LedgerDep
from service import ledger

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, sessions: LedgerDep, gateway: GatewayDep):
    """Ready when the ledger and Ray answer and the reconciler's ticks complete; each
    check says why when it is not."""
    checks = {}
    for name, probe in (("ledger", lambda: ledger.ping(sessions)), ("ray", gateway.ping)):
        try:
            await run_in_threadpool(probe)
            checks[name] = "ok"
        except Exception as e:  # any failure means not ready; say which and why
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            checks[name] = f"unavailable: {type(e).__name__}: {first}"[:300]
    if request.app.state.reconciling:
        problem = request.app.state.reconciler.health.problem()
        checks["reconciler"] = f"unavailable: {problem}" if problem else "ok"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    """Prometheus metrics: jobs by state, restarts, recovery seconds, steps recomputed, latency."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
