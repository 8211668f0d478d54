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


UNAUTHORIZED = "missing or wrong bearer token"


def token_ok(authorization: str | None, expected: str) -> bool:
    """`Authorization: Bearer <expected>`, parsed as HTTPBearer does, compared in constant time."""
    scheme, _, credentials = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and bool(credentials) and \
        secrets.compare_digest(credentials.encode(), expected.encode())


async def require_token(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    # api.app.BearerAuth has checked already, before the body was read; this dependency
    # is what puts the bearer scheme in the OpenAPI document (and guards an app without it).
    given = f"Bearer {credentials.credentials}" if credentials else None
    if not token_ok(given, request.app.state.token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


SettingsDep = Annotated[Settings, Depends(get_settings)]
LedgerDep = Annotated[sessionmaker[Session], Depends(get_ledger)]
GatewayDep = Annotated[Gateway, Depends(get_gateway)]
AuthDep = Depends(require_token)
