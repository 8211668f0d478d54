from fastapi import APIRouter, HTTPException, status
from fastapi.concurrency import run_in_threadpool

from api.deps import AuthDep, GatewayDep
from api.schemas import ClusterPublic
from service.gateway import GatewayError

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], dependencies=[AuthDep])


@router.get("", response_model=ClusterPublic)
async def cluster(gateway: GatewayDep) -> ClusterPublic:
    """Nodes, CPUs and GPUs (total and free), Ray version and dashboard URL."""
    try:
        return ClusterPublic(**await run_in_threadpool(gateway.cluster))
    except GatewayError as e:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"Ray is unreachable: {e}") from e
