"""Origins, Host, CORS pre-flight, the API key, /health and 405s, on the real app, no model."""

import pytest
from fakes.stub_backend import StubBackend
from litestar.testing import TestClient

from butter.http.access import AccessPolicy, is_loopback, origin_allowed
from butter.http.app import create_app, request_bodies


def client(backend=None, **policy) -> TestClient:
    policy.setdefault("loopback_only", True)
    app = create_app(backend or StubBackend(), access=AccessPolicy(**policy))
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_localhost_origins_are_allowed_with_cors_headers_others_get_403():
    with client() as http:
        ok = http.get("/v1/models", headers={"Origin": "http://localhost:5173"})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://localhost:5173"
        evil = http.post("/v1/chat/completions", content=b'{"messages": []}',
                         headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
        assert evil.status_code == 403
        assert evil.json()["error"]["type"] == "permission_error"
        assert "access-control-allow-origin" not in evil.headers
        anthropic = http.post("/v1/messages", json={}, headers={"Origin": "null"})
        assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"


def test_preflight_for_an_allowed_origin_and_refused_for_others():
    with client() as http:
        headers = {"Origin": "http://127.0.0.1:3000", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "content-type, authorization"}
        answer = http.options("/v1/chat/completions", headers=headers)
        assert answer.status_code == 204
        assert answer.headers["access-control-allow-origin"] == "http://127.0.0.1:3000"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert answer.headers["access-control-allow-headers"] == "content-type, authorization"
        headers["Origin"] = "http://attacker.test"
        assert http.options("/v1/chat/completions", headers=headers).status_code == 403


def test_configured_origins_replace_the_defaults():
    with client(allowed_origins=("https://app.example",)) as http:
        assert http.get("/health", headers={"Origin": "https://app.example"}).status_code == 200
        assert http.get("/health", headers={"Origin": "http://localhost:1"}).status_code == 403


def test_dns_rebinding_host_is_refused_while_on_loopback():
    with client() as http:
        assert http.get("/health", headers={"Host": "attacker.example:8000"}).status_code == 403
        assert http.get("/health", headers={"Host": "localhost:8000"}).status_code == 200
        assert http.get("/health", headers={"Host": "[::1]:8000"}).status_code == 200
    with client(loopback_only=False) as http:  # bound to a public address
        assert http.get("/health", headers={"Host": "myhost.lan:8000"}).status_code == 200


def test_api_key_guards_v1_routes_only():
    with client(api_key="sekret") as http:
        assert http.get("/health").status_code == 200
        missing = http.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/v1/models",
                        headers={"Authorization": "Bearer sekret"}).status_code == 200
        anthropic = http.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert anthropic.status_code == 401
        assert anthropic.json()["error"]["type"] == "authentication_error"
    with client() as http:  # without --api-key, Authorization is ignored
        assert http.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 200


def test_health_is_503_once_the_engine_died():
    backend = StubBackend()
    with client(backend) as http:
        assert http.get("/health").text == "ok"
        backend.healthy = False
        answer = http.get("/health")
        assert answer.status_code == 503


def test_405_says_which_methods_are_allowed():
    with client() as http:
        answer = http.get("/v1/chat/completions")
        assert answer.status_code == 405
        assert "POST" in answer.headers["allow"]
        assert answer.json()["error"]["code"] == "method_not_allowed"


def test_openapi_schema_publishes_every_route_with_its_request_body():
    with client() as http:
        schema = http.get("/schema/openapi.json").json()
    for path in ("/health", "/v1/models", "/metrics", *request_bodies()):
        assert path in schema["paths"], path
    for path, body in request_bodies().items():
        published = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert published["schema"] == body


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.1", True), ("[::1]", True),
    ("api.localhost", True), ("0.0.0.0", False), ("10.0.0.1", False), ("evil.com", False),
])
def test_loopback_names(host, loopback):
    assert is_loopback(host) is loopback


def test_origin_patterns():
    patterns = ("http://localhost:*", "https://app.example")
    assert origin_allowed("http://localhost:8080", patterns)
    assert not origin_allowed("http://localhost:80x", patterns)
    assert not origin_allowed("http://localhost.evil.com:80", patterns)
    assert origin_allowed("https://app.example/", patterns)
    assert not origin_allowed("https://app.example.evil", patterns)
    assert origin_allowed("anything", ("*",))
