"""GET /: the chat page with the cache inspector, plain static files shipped in the package."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def static_files() -> StaticFiles:
    """The page's script and style, mounted at /static."""
    return StaticFiles(directory=STATIC)
