"""The API's documentation pages, served with nothing fetched from outside the cluster.

FastAPI's default `/docs` page loads Swagger UI's script and style from a public CDN, so on an
offline cluster it is a blank page. Here `/v1/docs` (Swagger UI) and `/v1/redoc` (ReDoc) refer
only to same-origin URLs: the OpenAPI document and `/v1/docs/assets/<name>`, whose files come
from the `fastapi-offline` package (pinned in pyproject.toml), a maintained wheel that ships
Swagger UI 5 (which reads the OpenAPI 3.1 documents FastAPI writes; `swagger-ui-bundle`'s
Swagger UI 4 cannot) and ReDoc's standalone bundle. Only its files are used: its app factory
mounts a StaticFiles app outside our authorization table, so the routes are ours.

Swagger UI's validator badge (an image from validator.swagger.io) and ReDoc's Google fonts
are turned off for the same reason. The routes are public in `access.RULES`, as the OpenAPI
document itself is: they describe the API and hold no data.
"""

from __future__ import annotations

import functools
import importlib.resources

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from phalanx.errors import NotFound

OPENAPI_URL = "/v1/openapi.json"
DOCS_URL = "/v1/docs"
REDOC_URL = "/v1/redoc"
ASSETS_URL = "/v1/docs/assets"

# the files served, with their content types (nothing else under the package is reachable)
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}


@functools.cache
def asset(name: str) -> bytes:
    """One asset's bytes, read from the installed package once."""
    if name not in ASSETS:
        raise NotFound(
            f"no documentation asset {name!r}: the assets are {', '.join(sorted(ASSETS))}"
        )
    return (importlib.resources.files("fastapi_offline") / "static" / name).read_bytes()


def add_routes(app: FastAPI) -> None:
    """The OpenAPI document, the two documentation pages and their assets."""

    @app.get(OPENAPI_URL, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + OPENAPI_URL,
            title=f"{app.title} API",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + OPENAPI_URL,
            title=f"{app.title} API",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    @app.get(ASSETS_URL + "/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        return Response(
            asset(name),
            media_type=ASSETS[name],
            headers={"Cache-Control": "public, max-age=86400"},
        )
