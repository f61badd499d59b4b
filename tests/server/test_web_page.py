"""GET / serves the chat page and /static its files, all from the package, nothing from elsewhere."""

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from server.routes.web import STATIC

# Anything that would make the browser fetch from another origin: scripts, styles, fonts, images.
EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|@import|url\(\s*["']?(?:https?:)?//|fonts\.googleapis""")


async def test_the_page_and_its_files_are_served(client):
    page = await client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    linked = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert sorted(linked) == ["/static/chat.js", "/static/style.css"]
    imported = {f"/static/{name}" for path in STATIC.glob("*.js") for name in re.findall(
        r'from "\./([\w.]+)"', path.read_text())}
    for url in [*linked, *imported]:
        r = await client.get(url)
        assert r.status_code == 200, url
        kind = "text/css" if url.endswith(".css") else "javascript"
        assert kind in r.headers["content-type"], url
    assert imported == {"/static/api.js", "/static/inspector.js", "/static/markdown.js"}


async def test_the_page_is_not_in_the_api_document(client):
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)


def test_nothing_is_loaded_from_another_origin():
    files = sorted(STATIC.iterdir())
    assert {f.suffix for f in files} == {".html", ".css", ".js"}
    for path in files:
        assert not EXTERNAL.search(path.read_text()), path.name


def test_the_static_files_ship_in_the_package():
    """setuptools' package data must name every file, or a non-editable install serves a broken page."""
    config = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["server"]
    for path in STATIC.iterdir():
        assert any(fnmatch(path.relative_to(STATIC.parent).as_posix(), p) for p in patterns), path.name


async def test_the_page_tells_what_a_small_budget_forgets_and_the_setting_that_helps(client):
    page = (await client.get("/")).text
    note = re.search(r'<p id="budget-note"[^>]*>(.*?)</p>', page, re.S).group(1)
    assert "--policy full" in note and "--recall-budget" in note and "RESULTS.md" in note
