"""/v1/code: code archives that jobs name in `code` (the workers' working directory)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from api.deps import AuthDep, SettingsDep
from api.schemas import CodePublic, Message
from service import code
from service.admission import CODE_OFF, CodeOff

router = APIRouter(prefix="/v1/code", tags=["code"], dependencies=[AuthDep])
MEDIA_TYPE = "application/zip"

_ZIP_BODY = {"requestBody": {"required": True, "description": "A zip archive of the code; its root becomes the "
                             "working directory of the job's driver and workers.",
                             "content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=CodePublic, openapi_extra=_ZIP_BODY,
             responses={200: {"model": CodePublic, "description": "These very bytes were stored before."},
                        403: {"model": Message, "description": "The operator turned users' code off."},
                        413: {"model": Message, "description": "Over the service's size limit."},
                        415: {"model": Message, "description": f"Not sent as {MEDIA_TYPE}."},
                        422: {"model": Message, "description": "Not a zip, or an entry that would land outside "
                              "its root (.., absolute path, drive, symbolic link)."}})
async def upload_code(request: Request, response: Response, settings: SettingsDep) -> CodePublic:
    """Store a zip of your code; a job names it by the returned id in `code`. The id is the
    archive's SHA-256, so the same bytes again answer 200 with the same id."""
    if not settings.allow_code:
        raise CodeOff(f"{CODE_OFF}: code archives are refused")
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != MEDIA_TYPE:
        raise HTTPException(415,
                            f"send the archive as Content-Type: {MEDIA_TYPE}, not {media or 'nothing'}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_code_bytes:
        raise HTTPException(413, code.too_large(settings.max_code_bytes))
    upload = await run_in_threadpool(code.Upload, settings)
    try:
        # Counted as it arrives, whatever Content-Length said (api.app.BodyLimit lets this route be).
        async for chunk in request.stream():
            upload.write(chunk)
        code_id, created = await run_in_threadpool(upload.finish)
    except ClientDisconnect:
        return Response(status_code=status.HTTP_400_BAD_REQUEST)
    except code.TooLarge as e:
        raise HTTPException(413, str(e)) from None
    except code.BadArchive as e:
        raise HTTPException(422, str(e)) from None
    finally:
        await run_in_threadpool(upload.discard)
    if not created:
        response.status_code = status.HTTP_200_OK
    return CodePublic(**code.info(settings, code_id))


@router.get("/{code_id}", response_model=CodePublic, responses={404: {"model": Message}})
def get_code(code_id: str, settings: SettingsDep) -> CodePublic:
    """A stored archive's size and when it was stored."""
    found = code.info(settings, code_id)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no code archive {code_id!r}")
    return CodePublic(**found)
