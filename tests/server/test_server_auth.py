"""API keys and tenants (issue 15): `contbatch serve --api-key / --api-keys-file` require a key
on the /v1/ routes (401 with OpenAI's error JSON otherwise; /health and /metrics stay open), map
each key to a tenant, a priority and quotas (429 beyond them), and ignore X-Tenant unless the
operator trusts it (--trust-tenant-header). Keys are compared in constant time. Only
application/json bodies are accepted (415 otherwise)."""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from contbatch.cli.main import build_parser
from contbatch.cli.options import UsageError
from contbatch.cli.serve_cmd import build_app
from contbatch.loop import StepObserver
from contbatch.server import auth
from contbatch.server.auth import Gate, KeyPolicy, KeyRing, load_keys_file
from server.harness import RunningServer, start_app

MODEL = "keyed-model"
KEYS = {
    "sk-team-a": {"tenant": "team-a", "priority": 2},
    "sk-team-b": {"tenant": "team-b"},
    "sk-one-at-a-time": {"tenant": "solo", "max_concurrent": 1},
    "sk-bursty": {"tenant": "bursty", "rate": 0.001, "burst": 2},
}
BODY = {"model": MODEL, "prompt": "hi there", "max_tokens": 1}


def serve(*flags: str) -> RunningServer:
    args = build_parser().parse_args(
        ["serve", "--backend", "sim", "--cost", "affine:base_ms=2", "--served-model-name", MODEL, *flags]
    )
    return start_app(build_app(args))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    lines = [f"{key}: {json.dumps(policy)}" for key, policy in KEYS.items()]  # YAML flow mappings
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def keyed(keys_file: Path) -> Iterator[RunningServer]:
    server = serve("--api-keys-file", str(keys_file), "--api-key", "sk-plain")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def trusting(keys_file: Path) -> Iterator[RunningServer]:
    server = serve("--api-keys-file", str(keys_file), "--trust-tenant-header")
    yield server
    server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    assert error["type"] == kind and error["code"] == code
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    return dict(error)


class Seen(StepObserver):
    """Records the tenant and priority of every finished request, by the prompt's length."""

    def __init__(self) -> None:
        self.finished: list[tuple[str | None, int]] = []
        self.lock = threading.Lock()

    def on_finished(self, request: Any, final: object = None) -> None:
        with self.lock:
            self.finished.append((request.tenant, request.priority))


def seen_by(server: RunningServer) -> Seen:
    spy = Seen()
    server.client.driver.core.observers.append(spy)
    return spy


# -- keys ---------------------------------------------------------------------------------------
def test_the_right_key_is_served_a_wrong_or_missing_one_gets_401(keyed: RunningServer) -> None:
    for key in ("sk-team-a", "sk-plain"):
        r = keyed.post("/v1/completions", json=BODY, headers=bearer(key))
        assert r.status_code == 200, r.text
        r = keyed.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, headers=bearer(key)
        )
        assert r.status_code == 200, r.text
    for headers in (
        {},
        bearer("sk-team-"),  # a prefix of a key
        bearer("sk-team-aa"),  # a key plus one character
        bearer("SK-TEAM-A"),
        {"Authorization": "sk-team-a"},  # no scheme
        {"Authorization": "Basic sk-team-a"},
        {"Authorization": "Bearer"},
    ):
        r = keyed.post("/v1/completions", json=BODY, headers=headers)
        error = assert_openai_error(r, 401, "invalid_api_key")
        assert "sk-" not in error["message"]  # a key, right or wrong, is never echoed
        assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(keyed.get("/v1/models"), 401, "invalid_api_key")
    assert keyed.get("/v1/models", headers=bearer("sk-team-b")).status_code == 200
    # a bad key on an unknown /v1/ route: 401 before 404, so routes cannot be probed without a key
    assert keyed.post("/v1/nothing", json={}).status_code == 401
    keyed.wait_idle()


def test_health_and_metrics_stay_open(keyed: RunningServer) -> None:
    assert keyed.get("/health").status_code == 200
    r = keyed.get("/metrics")
    assert r.status_code == 200 and "# TYPE" in r.text


def test_the_official_client_sends_its_key(keyed: RunningServer) -> None:
    good = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sk-team-b", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hello", max_tokens=2).usage is not None
    bad = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert info.value.code == "invalid_api_key"


def test_the_key_decides_the_tenant_and_x_tenant_is_ignored(keyed: RunningServer) -> None:
    spy = seen_by(keyed)
    for key, claimed in (("sk-team-a", None), ("sk-team-a", "team-b"), ("sk-team-b", "team-a"), ("sk-plain", "x")):
        headers = bearer(key) | ({"X-Tenant": claimed} if claimed else {})
        assert keyed.post("/v1/completions", json=BODY, headers=headers).status_code == 200
        keyed.wait_idle()
    # sk-team-a runs at priority 2 (its key's); sk-plain has no tenant and the default priority
    assert spy.finished == [("team-a", 2), ("team-a", 2), ("team-b", 0), (None, 0)]
    # an untrusted X-Tenant is not even read: a malformed one is no error
    assert (
        keyed.post("/v1/completions", json=BODY, headers=bearer("sk-team-b") | {"X-Tenant": "a b"}).status_code == 200
    )


def test_a_request_may_lower_its_urgency_never_raise_it(keyed: RunningServer) -> None:
    spy = seen_by(keyed)
    for key, asked in (("sk-team-a", 5), ("sk-team-a", 0), ("sk-team-a", -3), ("sk-team-b", -3)):
        body = BODY | {"priority": asked}
        assert keyed.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
        keyed.wait_idle()
    # team-a's key has priority 2: 5 is allowed (less urgent), 0 and -3 become 2; team-b has none
    assert [p for _, p in spy.finished] == [5, 2, 2, -3]


def test_a_trusted_x_tenant_wins_over_the_key(trusting: RunningServer) -> None:
    spy = seen_by(trusting)
    assert (
        trusting.post("/v1/completions", json=BODY, headers=bearer("sk-team-a") | {"X-Tenant": "edge-1"}).status_code
        == 200
    )
    trusting.wait_idle()
    assert trusting.post("/v1/completions", json=BODY, headers=bearer("sk-team-a")).status_code == 200
    trusting.wait_idle()
    assert [t for t, _ in spy.finished] == ["edge-1", "team-a"]
    r = trusting.post("/v1/completions", json=BODY, headers=bearer("sk-team-a") | {"X-Tenant": "a b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Tenant"
    assert_openai_error(
        trusting.post("/v1/completions", json=BODY, headers={"X-Tenant": "team-a"}), 401, "invalid_api_key"
    )


def test_without_keys_x_tenant_counts_only_when_trusted() -> None:
    for flags, expected in (((), None), (("--trust-tenant-header",), "edge-2")):
        server = serve(*flags)
        try:
            spy = seen_by(server)
            assert server.post("/v1/completions", json=BODY, headers={"X-Tenant": "edge-2"}).status_code == 200
            server.wait_idle()
            assert spy.finished == [(expected, 0)]
        finally:
            server.stop()


# -- quotas ---------------------------------------------------------------------------------------
def test_max_concurrent_refuses_a_second_request_in_flight(keyed: RunningServer) -> None:
    body = BODY | {"max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", keyed.base_url + "/v1/completions", json=body, headers=bearer("sk-one-at-a-time")
        ) as s:
            assert s.status_code == 200
            lines = s.iter_lines()  # kept: a dropped line iterator closes the response
            next(lines)  # the stream is under way
            r = http.post(keyed.base_url + "/v1/completions", json=BODY, headers=bearer("sk-one-at-a-time"))
            error = assert_openai_error(r, 429, "rate_limit_exceeded")
            assert "in flight" in error["message"] and int(r.headers["retry-after"]) >= 1
            # other keys are not held back
            assert (
                http.post(keyed.base_url + "/v1/completions", json=BODY, headers=bearer("sk-team-b")).status_code == 200
            )
        # the client left: once the server has seen it go, the slot is free again (a generous bound:
        # a loaded machine may take a while to notice the disconnect)
        deadline = time.monotonic() + 60
        while True:
            r = http.post(keyed.base_url + "/v1/completions", json=BODY, headers=bearer("sk-one-at-a-time"))
            if r.status_code != 429:
                break
            assert time.monotonic() < deadline, "the slot was never given back"
            time.sleep(0.05)
        assert r.status_code == 200
    keyed.wait_idle()


def test_the_token_bucket_allows_its_burst_then_429(keyed: RunningServer) -> None:
    codes = [keyed.post("/v1/completions", json=BODY, headers=bearer("sk-bursty")).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    r = keyed.post("/v1/completions", json=BODY, headers=bearer("sk-bursty"))
    error = assert_openai_error(r, 429, "rate_limit_exceeded")
    assert "rate" in error["message"] and int(r.headers["retry-after"]) > 100  # 1 request per 1000 s
    # refusals cost no bucket tokens; a GET costs none either
    assert keyed.get("/v1/models", headers=bearer("sk-bursty")).status_code == 200


def test_the_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    gate = Gate(lambda *a: None, {"k": KeyPolicy(rate=2.0, burst=3)}, clock=lambda: now[0])
    assert gate.keys is not None
    state = gate.keys.find(b"k")
    assert state is not None

    def take() -> bool:
        refused = state.refusal(now[0]) is not None
        if not refused:
            state.in_flight -= 1
        return not refused

    assert [take() for _ in range(4)] == [True, True, True, False]
    now[0] = 0.4  # 0.8 of a token back
    assert not take()
    now[0] = 0.5  # 1.0 back (0.8 + 0.2)
    assert take() and not take()
    now[0] = 100.0  # refills to the burst, not beyond
    assert [take() for _ in range(4)] == [True, True, True, False]


# -- the keys file and flags ----------------------------------------------------------------------
def test_keys_files_in_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text(json.dumps({"sk-1": {"tenant": "t", "rate": 1.5}, "sk-2": None}))
    (tmp_path / "k.yml").write_text("sk-1:\n  tenant: t\n  rate: 1.5\nsk-2:\n")
    for name in ("k.json", "k.yml"):
        keys = load_keys_file(tmp_path / name)
        assert keys == {"sk-1": KeyPolicy(tenant="t", rate=1.5), "sk-2": KeyPolicy()}
    assert KeyPolicy(rate=1.5).bucket_size == 2.0 and KeyPolicy(rate=0.1).bucket_size == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sk-secret-1: {tenant: 'a b'}", "tenant must be"),
        ("sk-secret-1: {tenant: a, quota: 3}", "unknown field(s) quota"),
        ("sk-secret-1: {burst: 3}", "burst needs a rate"),
        ("sk-secret-1: {rate: 0}", "rate must be a number > 0"),
        ("sk-secret-1: {max_concurrent: 0}", "max_concurrent must be an integer >= 1"),
        ("sk-secret-1: {priority: high}", "priority must be an integer"),
        ("sk-secret-1: [a]", "must be a mapping"),
        ("'sk secret': {}", "visible ASCII"),
        ("[sk-secret-1]", "non-empty mapping"),
        ("sk-secret-1: {tenant: [", "not valid YAML"),
    ],
)
def test_a_bad_keys_file_is_refused_without_showing_a_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["serve", "--api-keys-file", str(path)])
    with pytest.raises(UsageError, match="--api-keys-file") as info:
        build_app(args)
    assert message in str(info.value)
    assert "secret" not in str(info.value).replace(str(path), "")


def test_bad_key_flags_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from contbatch.cli.main import main

    for argv in (["--api-key", "has space"], ["--api-keys-file", str(tmp_path / "missing.yaml")]):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("contbatch serve: error: --api-key") and err.count("\n") == 1


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured key is compared, by `hmac.compare_digest` on SHA-256 digests (equal
    lengths), whether the presented key matches the first, the last or none."""
    ring = KeyRing({f"sk-{i}": KeyPolicy(tenant=f"t{i}") for i in range(50)})
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for presented, tenant in ((b"sk-0", "t0"), (b"sk-49", "t49"), (b"sk-", None), (b"x" * 10_000, None)):
        calls.clear()
        found = ring.find(presented)
        assert (found.policy.tenant if found is not None else None) == tenant
        assert calls == [(32, 32)] * 50


# -- content type ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data", ""],
)
def test_only_json_bodies_are_accepted(keyed: RunningServer, content_type: str | None) -> None:
    headers = bearer("sk-team-b") | ({"content-type": content_type} if content_type is not None else {})
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = keyed.post(path, content=json.dumps(BODY).encode(), headers=headers)
        error = assert_openai_error(r, 415, "unsupported_media_type")
        assert "application/json" in error["message"]
    assert keyed.get("/health").status_code == 200


def test_json_with_parameters_is_accepted(keyed: RunningServer) -> None:
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = keyed.post(
            "/v1/completions",
            content=json.dumps(BODY).encode(),
            headers=bearer("sk-team-b") | {"content-type": content_type},
        )
        assert r.status_code == 200, (content_type, r.text)
    keyed.wait_idle()
