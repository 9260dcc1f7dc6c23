"""The gateway takes the server's API keys (`contbatch.server.auth`): 401 without a good key on
the /v1/ routes, /health and /metrics open, per-key quotas; upstream it sends its own key, or
passes the client's through when it has none; a key's tenant goes upstream as X-Tenant."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.harness import MODEL, RunningServer

from contbatch.server.auth import KeyPolicy
from contbatch.server.serving import ServerConfig
from gateway.fakes import FakeBackend
from gateway.harness import RunningApp, RunningGateway

BODY = {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "ignore_eos": True}
ERRORS = "contbatch:gateway_http_request_errors_total"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keys_of_the_gateway_and_upstream(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    backend = make_server(server_config=ServerConfig(api_keys={"sk-up": KeyPolicy()}, shutdown_grace_s=1.0))
    gateway = make_gateway([backend.base_url], api_keys={"sk-gw": KeyPolicy()}, upstream_api_key="sk-up")
    missing = gateway.post("/v1/completions", json=BODY)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert gateway.post("/v1/completions", json=BODY, headers=bearer("sk-up")).status_code == 401  # not the gateway's
    assert gateway.get("/v1/models").status_code == 401
    assert gateway.post("/v1/completions", json=BODY, headers=bearer("sk-gw")).status_code == 200
    assert gateway.get("/v1/models", headers=bearer("sk-gw")).json()["data"][0]["id"] == MODEL
    assert gateway.get("/health").status_code == 200  # open, as the server's
    assert gateway.metrics()[(ERRORS, (("status", "401"),))] == 3.0
    # a gateway without the upstream key: the backend refuses it, which is the gateway's fault
    keyless = make_gateway([backend.base_url], api_keys={"sk-gw": KeyPolicy()})
    refused = keyless.post("/v1/completions", json=BODY, headers=bearer("sk-gw"))
    assert refused.status_code == 502 and "credentials" in refused.json()["error"]["message"]


def test_without_keys_of_its_own_the_clients_key_passes_through(
    make_server: Callable[..., RunningServer], make_gateway: Callable[..., RunningGateway]
) -> None:
    backend = make_server(server_config=ServerConfig(api_keys={"sk-up": KeyPolicy()}, shutdown_grace_s=1.0))
    gateway = make_gateway([backend.base_url])
    assert gateway.post("/v1/completions", json=BODY, headers=bearer("sk-up")).status_code == 200
    relayed = gateway.post("/v1/completions", json=BODY)
    assert relayed.status_code == 401 and relayed.json()["error"]["code"] == "invalid_api_key"


def test_quotas_and_tenants(
    serve_app: Callable[[Any], RunningApp], make_gateway: Callable[..., RunningGateway]
) -> None:
    fake = FakeBackend()
    keys = {"sk-a": KeyPolicy(tenant="team-a", rate=0.001, burst=2), "sk-b": KeyPolicy()}
    gateway = make_gateway([serve_app(fake.app()).base_url], api_keys=keys, upstream_api_key="sk-up")
    answers = [gateway.post("/v1/completions", json=BODY, headers=bearer("sk-a")).status_code for _ in range(3)]
    assert answers == [200, 200, 429]  # a burst of 2, then over its rate
    assert gateway.post("/v1/completions", json=BODY, headers={**bearer("sk-b"), "X-Tenant": "x"}).status_code == 200
    tenants = [seen["headers"].get("x-tenant") for seen in fake.seen]
    assert tenants == ["team-a", "team-a", None]  # X-Tenant is not trusted unless configured
    assert {seen["headers"]["authorization"] for seen in fake.seen} == {"Bearer sk-up"}
    assert all(seen["headers"]["x-request-id"] for seen in fake.seen)
    trusting = make_gateway([serve_app(fake.app()).base_url], trust_tenant_header=True)
    assert trusting.post("/v1/completions", json=BODY, headers={"X-Tenant": "x"}).status_code == 200
    assert fake.seen[-1]["headers"]["x-tenant"] == "x"
    assert trusting.post("/v1/completions", json=BODY, headers={"X-Tenant": "bad tenant"}).status_code == 400
