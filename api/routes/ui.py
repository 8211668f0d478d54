"""The web page at / and Swagger UI at /docs, both from files shipped in api/static (no CDN).
Neither needs the token: they hold no data; the page asks /v1 with the token the user gives it."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from workers.events import FAILURES, Kind

STATIC = Path(__file__).resolve().parents[1] / "static"
SWAGGER = "/static/vendor/swagger"

router = APIRouter(include_in_schema=False)


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC)


@router.get("/")
def index() -> FileResponse:
    # no-cache: a browser left open across an upgrade revalidates instead of running old JS
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


# The run record's event kinds as the page's constants: made from workers.events, so the
# page and the workers cannot disagree on a name.
KINDS_JS = (f"const KIND = Object.freeze({json.dumps({k.name: k.value for k in Kind})});\n"
            f"const FAILURE_KINDS = new Set({json.dumps(sorted(FAILURES))});\n")


@router.get("/kinds.js")
def kinds() -> Response:
    return Response(KINDS_JS, media_type="text/javascript", headers={"Cache-Control": "no-cache"})


@router.get("/docs")
def docs(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url, title=f"{request.app.title} API",
        swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js", swagger_css_url=f"{SWAGGER}/swagger-ui.css",
        swagger_favicon_url=f"{SWAGGER}/favicon-32x32.png",
        # validatorUrl off: Swagger UI would otherwise send the schema to validator.swagger.io
        swagger_ui_parameters={"persistAuthorization": True, "validatorUrl": None})
