"""Each role's OpenAPI document, fetched from real processes: valid OpenAPI 3, every route
the app serves in it with its methods, the inference routes' bodies generated from
`helexa.protocol.bodies`, and a browsable page at /docs."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest
from litestar import Litestar
from litestar.routes import HTTPRoute
from openapi_spec_validator import validate

from helexa.config import load_config
from helexa.node.service import build_node
from helexa.protocol import bodies
from helexa.web.gateway_app import create_gateway_apps
from helexa.web.gateway_asgi import ROUTES as GATEWAY_COUNTED_ROUTES
from helexa.web.node_app import create_node_app
from helexa.web.openapi import ASSETS
from tests.gateway.gateway_proc import start_gateway
from tests.web.node_proc import scripted_model, start_node

KEY = "node-secret"
# What a document leaves out, and why: the admin console's HTML pages and its static files,
# and the document and its page themselves.
UNDOCUMENTED = ("/admin", "/docs", "/openapi.json")
REF = "#/components/schemas/"


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doc-node")
    proc = start_node(tmp, [scripted_model(tmp, "hello")], node={"api_key": KEY})
    yield proc
    proc.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    proc = start_gateway(tmp_path_factory.mktemp("doc-gateway"), {})
    yield proc
    proc.stop(signal.SIGTERM)


def _config(tmp: Path, toml: str):
    path = tmp / "helexa.toml"
    path.write_text(f'[node]\nstate_dir = "{tmp}"\n{toml}')
    return load_config(path, env={})


@pytest.fixture(scope="module")
def node_app(tmp_path_factory) -> Litestar:
    """The app a node process serves, built here to read its routes."""
    return create_node_app(build_node(_config(tmp_path_factory.mktemp("node-app"), "")))


@pytest.fixture(scope="module")
def gateway_apps(tmp_path_factory) -> tuple[Litestar, Litestar]:
    """The gateway's API and metrics apps, built here to read their routes."""
    cfg = _config(tmp_path_factory.mktemp("gateway-app"), '[gateway]\nlisten = "127.0.0.1:1"\n')
    api, metrics = create_gateway_apps(cfg)
    return api.app, metrics


def served(app: Litestar) -> set[tuple[str, str]]:
    """(method, path) of every route `app` answers, bar the OPTIONS Litestar adds to each
    and what is left out of documents on purpose (checked to be only that)."""
    routes = set()
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            if method == "OPTIONS" and not handler.resolve_include_in_schema():
                continue
            path = route.path_format or "/"
            if handler.resolve_include_in_schema():
                routes.add((method, path))
            else:
                assert path.startswith(UNDOCUMENTED), f"{method} {path} is left out of the document"
    return routes


def documented(doc: dict) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in item if m != "parameters"}


def fetch_document(base_url: str) -> dict:
    """The document at /openapi.json, the same one the page loads, checked to be OpenAPI 3."""
    doc = httpx.get(base_url + "/openapi.json", timeout=30).json()
    assert httpx.get(base_url + "/docs/openapi.json", timeout=30).json() == doc
    assert doc["openapi"].startswith("3.")
    validate(doc)
    return doc


def body_schema(doc: dict, path: str) -> dict:
    """The component schema of `path`'s POST body, which must be a reference to one."""
    content = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    ref = content["schema"]["$ref"]
    assert ref.startswith(REF)
    return doc["components"]["schemas"][ref.removeprefix(REF)] | {"name": ref.removeprefix(REF)}


def assert_page_shows(base_url: str, component: str) -> None:
    """/docs is Swagger UI's page over the document, the types it names included, and every
    file it loads comes from the same server (a host without internet shows it too)."""
    page = httpx.get(base_url + "/docs", timeout=30)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle" in page.text and f'"{REF}{component}"' in page.text
    loaded = re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+)"', page.text)
    assert sorted(loaded) == sorted(f"/docs/assets/{name}" for name in ASSETS), loaded
    for url in loaded:
        asset = httpx.get(base_url + url, timeout=30)
        assert asset.status_code == 200, url
        assert asset.headers["content-type"].split(";")[0] in ("text/javascript", "text/css")
        assert len(asset.content) > 10_000, url
    # only those files: nothing else of the folder (a keyed node's door answers first)
    assert httpx.get(base_url + "/docs/assets/LICENSE", timeout=30).status_code in (401, 404)


def test_the_node_documents_every_route_it_serves(keyed_node, node_app):
    doc = fetch_document(keyed_node.base_url)
    missing = served(node_app) - documented(doc)
    assert not missing, f"served but not documented: {sorted(missing)}"
    assert documented(doc) <= served(node_app)


def test_the_node_documents_its_inference_bodies_from_the_protocol_types(keyed_node):
    doc = fetch_document(keyed_node.base_url)
    for path, body in [
        ("/v1/chat/completions", bodies.ChatCompletionBody),
        ("/v1/completions", bodies.CompletionBody),
        ("/v1/responses", bodies.ResponsesBody),
        ("/tokenize", bodies.TokenizeBody),
        ("/models/load", bodies.LoadBody),
    ]:
        schema = body_schema(doc, path)
        assert schema["name"] == body.__name__
        assert set(schema["properties"]) == body.__required_keys__ | body.__optional_keys__
        assert set(schema["required"]) == set(body.__required_keys__)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["200"]["content"]["application/json"]["schema"]["$ref"] == REF + "ChatCompletion"
    assert (
        chat["200"]["content"]["text/event-stream"]["schema"]["$ref"] == REF + "ChatCompletionChunk"
    )
    assert chat["default"]["content"]["application/json"]["schema"]["$ref"] == (
        REF + "ErrorEnvelope"
    )


def test_a_keyed_node_serves_its_document_and_page_openly_and_says_what_the_rest_needs(
    keyed_node,
):
    assert httpx.get(keyed_node.base_url + "/v1/models", timeout=30).status_code == 401
    doc = fetch_document(keyed_node.base_url)  # no key sent
    assert_page_shows(keyed_node.base_url, "ChatCompletionBody")
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "Bearer <api key>",
    }
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []  # open, as the door has it
    assert "security" not in doc["paths"]["/v1/models"]["get"]


def test_the_gateway_documents_every_route_it_serves_the_anthropic_ones_included(
    gateway, gateway_apps
):
    api, _ = gateway_apps
    doc = fetch_document(gateway.base_url)
    missing = served(api) - documented(doc)
    assert not missing, f"served but not documented: {sorted(missing)}"
    assert documented(doc) <= served(api)
    # the routes the outer ASGI layer counts by name are routes the document has
    assert {path for _, path in documented(doc)} >= GATEWAY_COUNTED_ROUTES
    for path, body in [
        ("/v1/chat/completions", bodies.ChatCompletionBody),
        ("/v1/completions", bodies.CompletionBody),
        ("/v1/responses", bodies.ResponsesBody),
        ("/v1/messages", bodies.MessagesBody),
        ("/v1/messages/count_tokens", bodies.CountTokensBody),
    ]:
        assert body_schema(doc, path)["name"] == body.__name__
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]
    assert messages["200"]["content"]["application/json"]["schema"]["$ref"] == (
        REF + "MessageAnswer"
    )
    assert messages["default"]["content"]["application/json"]["schema"]["$ref"] == (
        REF + "AnthropicErrorBody"
    )
    # keys in either header, and (no require_auth) none at all
    assert doc["security"] == [{"bearer": []}, {"x-api-key": []}, {}]
    assert_page_shows(gateway.base_url, "MessagesBody")


def test_the_gateway_metrics_port_documents_its_route(gateway, gateway_apps):
    _, metrics = gateway_apps
    doc = fetch_document(gateway.metrics_url)
    assert documented(doc) == served(metrics) == {("GET", "/metrics")}
    assert "text/plain" in next(
        iter(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"])
    )


def test_the_nodes_page_renders_every_operation_in_a_browser_without_internet(keyed_node):
    """Debian's chromium, headless, with every request off this host refused: the page
    draws one operation block per documented route."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if chromium is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run does)")
    operations = documented(fetch_document(keyed_node.base_url))
    elsewhere: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            tab = browser.new_page()

            def only_here(route) -> None:
                if route.request.url.startswith(keyed_node.base_url):
                    route.continue_()
                else:
                    elsewhere.append(route.request.url)
                    route.abort()

            tab.route("**/*", only_here)
            tab.goto(keyed_node.base_url + "/docs")
            tab.wait_for_selector(".opblock", timeout=30_000)
            drawn = tab.locator(".opblock").count()
        finally:
            browser.close()
    assert not elsewhere, elsewhere
    assert drawn == len(operations), (drawn, sorted(operations))
