"""Browsers and keys against a real server: Origin, Host, CORS, --api-key, via the SDKs."""

import anthropic
import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "Say hi."}]
BODY = {"model": "smollm2", "messages": QUESTION, "max_tokens": 4}
# A generation on a busy 2-core machine can take longer than httpx's 5 s default.
http = httpx.Client(timeout=120)


def test_a_foreign_origin_or_host_is_refused_and_localhost_pages_get_cors(server):
    url = f"{server.base_url}/chat/completions"
    refused = http.post(url, json=BODY, headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"
    # A cross-site form post: text/plain needs no pre-flight in a browser, so Origin decides.
    form = http.post(url, content=b'{"model":"smollm2"}', headers={
        "Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert form.status_code == 403
    rebinding = http.post(url, json=BODY, headers={"Host": "evil.example"})
    assert rebinding.status_code == 403
    page = http.post(url, json=BODY, headers={"Origin": "http://localhost:5173"})
    assert page.status_code == 200
    assert page.headers["access-control-allow-origin"] == "http://localhost:5173"
    preflight = http.options(url, headers={"Origin": "http://127.0.0.1:3000",
                                            "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 204
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert http.post(url, json=BODY).status_code == 200  # curl -d: no Origin at all


def test_allowed_origins_replaces_the_localhost_default(start_server):
    server = start_server("--allowed-origins", "https://app.example,http://tools.example:*")
    url = f"{server.base_url}/chat/completions"
    for origin, status in (("https://app.example", 200), ("http://tools.example:8080", 200),
                           ("http://localhost:5173", 403), ("https://app.example.evil", 403)):
        assert http.post(url, json=BODY, headers={"Origin": origin}).status_code == status


def test_api_key_is_required_on_v1_when_set(start_server):
    server = start_server("--api-key", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(model="smollm2", messages=QUESTION,
                                          max_tokens=4).choices[0].message.content is not None
    claude = anthropic.Anthropic(base_url=server.root, api_key="s3cret", max_retries=0)
    assert claude.messages.create(model="smollm2", messages=QUESTION, max_tokens=4).content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.root, api_key="nope", max_retries=0).messages.create(
            model="smollm2", messages=QUESTION, max_tokens=4)
    assert http.get(f"{server.root}/health").status_code == 200  # probes need no key


def test_without_api_key_authorization_is_ignored(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="anything at all", max_retries=0)
    assert client.models.list().data[0].id == "smollm2"
