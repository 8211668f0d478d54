"""Annotated dependencies; tests swap them with app.dependency_overrides."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from service.gateway import Gateway
from service.settings import Settings

_bearer = HTTPBearer(auto_error=False)
# Async because they do no I/O: a plain def would cost a thread hand-off per request.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_ledger(request: Request) -> sessionmaker[Session]:
    return request.app.state.ledger


async def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def require_token(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    expected = request.app.state.token
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
LedgerDep = Annotated[sessionmaker[Session], Depends(get_ledger)]
GatewayDep = Annotated[Gateway, Depends(get_gateway)]
AuthDep = Depends(require_token)
