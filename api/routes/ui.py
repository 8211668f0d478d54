"""The web page at / and Swagger UI at /docs, both from files shipped in api/static (no CDN).
Neither needs the token: they hold no data; the page asks /v1 with the token the user gives it."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[1] / "static"
SWAGGER = "/static/vendor/swagger"

router = APIRouter(include_in_schema=False)


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)


@router.get("/")
def index() -> FileResponse:
    # no-cache: a browser left open across an upgrade revalidates instead of running old JS
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/docs")
def docs(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url, title=f"{request.app.title} API",
        swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js", swagger_css_url=f"{SWAGGER}/swagger-ui.css",
        swagger_favicon_url=f"{SWAGGER}/favicon-32x32.png",
        # validatorUrl off: Swagger UI would otherwise send the schema to validator.swagger.io
        swagger_ui_parameters={"persistAuthorization": True, "validatorUrl": None})
