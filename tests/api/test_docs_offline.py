"""/v1/docs and /v1/redoc work on a cluster with no way out: every URL the pages load is on
the controller itself, and each answers with the asset and the right content type."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from phalanx.controller import docs_ui

CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".json": "application/json",
}


class References(HTMLParser):
    """Every URL a page makes the browser load: src, href, ReDoc's spec-url, and the `url:`
    Swagger UI's inline script fetches the OpenAPI document from."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self._script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "spec-url") and value:
                self.urls.append(value)
        self._script = tag == "script"

    def handle_data(self, data: str) -> None:
        if self._script:
            self.urls += re.findall(r"\burl:\s*'([^']*)'", data)

    def handle_endtag(self, tag: str) -> None:
        self._script = False


@pytest.mark.parametrize("page", ["/v1/docs", "/v1/redoc"])
def test_pages_load_only_same_origin_assets(client: TestClient, page: str) -> None:
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text, r.text
    refs = References()
    refs.feed(r.text)
    assert len(refs.urls) >= 3, refs.urls  # the document, a script, the icon at least
    for url in refs.urls:
        assert url.startswith("/") and not url.startswith("//"), url
        got = client.get(url)  # no credential: the pages are public, and so is what they load
        assert got.status_code == 200, (url, got.status_code)
        suffix = url[url.rfind(".") :]
        assert got.headers["content-type"].startswith(CONTENT_TYPES[suffix]), (url, got.headers)
        assert len(got.content) > 100, url


def test_the_assets_are_what_their_names_say(client: TestClient) -> None:
    bundle = client.get("/v1/docs/assets/swagger-ui-bundle.js").text
    assert "SwaggerUIBundle" in bundle
    # Swagger UI 5 or later: FastAPI writes OpenAPI 3.1, which Swagger UI 4 cannot show
    doc = client.get("/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    assert "Redoc" in client.get("/v1/docs/assets/redoc.standalone.js").text
    css = client.get("/v1/docs/assets/swagger-ui.css")
    assert ".swagger-ui" in css.text and "max-age" in css.headers["cache-control"]


@pytest.mark.parametrize("name", ["core.py", "..%2Fcore.py", "index.html", "%2Fetc%2Fpasswd"])
def test_nothing_else_is_served(client: TestClient, name: str) -> None:
    r = client.get(f"/v1/docs/assets/{name}")
    assert r.status_code == 404
    body = r.json()
    if "error" in body:  # a name the route took: refused by name (others match no route)
        assert "no documentation asset" in body["error"]["message"]
    assert "import" not in r.text


def test_every_asset_ships_with_the_package() -> None:
    for name in docs_ui.ASSETS:
        assert docs_ui.asset(name), name
