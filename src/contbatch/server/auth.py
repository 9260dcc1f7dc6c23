"""API keys, tenants and the gate in front of the routes.

`Gate` is an ASGI middleware that answers, before any route runs:

- **401** on the ``/v1/`` routes when API keys are configured and the request has none
  (``Authorization: Bearer KEY``) or a wrong one, with OpenAI's error JSON (type
  ``invalid_request_error``, code ``invalid_api_key``). ``/health`` and ``/metrics`` stay open
  (load balancers and Prometheus scrape them without a key). A presented key is hashed
  (SHA-256) and compared with every configured key's hash by `hmac.compare_digest`, without
  stopping at a match: the time taken says nothing about which key, or how much of one, matched.
- **415** on every ``POST`` whose body is not declared ``application/json`` (a missing
  ``Content-Type`` included): a web page cannot send a blind cross-origin request with that type
  without a CORS preflight, which this server never answers, so no page can drive it.
- **429** (with ``Retry-After``) when the key is over one of its quotas on a generation route:
  ``max_concurrent`` requests in flight (a stream counts until it ends), or its token bucket of
  ``rate`` requests per second with room for ``burst`` at once.

A key maps to a `KeyPolicy`: its tenant, its priority and its quotas. The tenant of a request is
its key's tenant; ``X-Tenant`` is honoured only when the operator trusts it
(``--trust-tenant-header``, for a gateway that authenticates users itself), and then it wins over
the key's. The key's priority is the default priority of its requests and the most urgent one
they may ask for (lower runs first): a request may ask for a larger ``priority`` value, never a
smaller one.

Keys come from ``--api-key KEY`` (no tenant, no quotas) and from a keys file (`load_keys_file`),
JSON or YAML, mapping each key to its policy::

    sk-team-a: {tenant: team-a, priority: 0, max_concurrent: 16, rate: 5, burst: 20}
    sk-batch: {tenant: batch, priority: 10}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from contbatch.server.protocol import MAX_INT, APIError, bad

TENANT_HEADER = "x-tenant"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._:@/+-]{1,128}")
KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,512}")  # visible ASCII, no spaces
GUARDED_PREFIX = "/v1/"  # routes that need a key (when keys are configured)
JSON_TYPE = "application/json"
_STATE_KEY = "contbatch_key"  # where the gate leaves the request's KeyPolicy (scope["state"])
_FIELDS = ("tenant", "priority", "max_concurrent", "rate", "burst")


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    tenant: str | None = None  # the tenant of the key's requests (None: no tenant)
    priority: int | None = None  # default priority, and the most urgent one its requests may ask for
    max_concurrent: int | None = None  # requests in flight at once (a stream counts until it ends)
    rate: float | None = None  # requests per second, sustained (token bucket)
    burst: int | None = None  # requests at once beyond the rate (bucket size; default max(1, ceil(rate)))

    def __post_init__(self) -> None:
        if self.tenant is not None and not (isinstance(self.tenant, str) and TENANT_PATTERN.fullmatch(self.tenant)):
            raise ValueError(f"tenant must be 1 to 128 characters of letters, digits and ._:@/+-, got {self.tenant!r}")
        if self.priority is not None and not (_is_int(self.priority) and -MAX_INT <= self.priority <= MAX_INT):
            raise ValueError(f"priority must be an integer from {-MAX_INT} to {MAX_INT}, got {self.priority!r}")
        for name in ("max_concurrent", "burst"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        rate = self.rate
        if rate is not None and not (_is_number(rate) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a number > 0 (requests per second), got {rate!r}")
        if self.burst is not None and rate is None:
            raise ValueError("burst needs a rate")

    @property
    def bucket_size(self) -> float:
        return float(self.burst) if self.burst is not None else max(1.0, math.ceil(self.rate or 1.0))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_key(key: object) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise ValueError("an API key must be 1 to 512 visible ASCII characters (no spaces)")
    return key


def load_keys_file(path: str | Path) -> dict[str, KeyPolicy]:
    """The keys of a JSON or YAML file mapping each key to its policy (an object with some of
    tenant, priority, max_concurrent, rate, burst; null or {} for none); ValueError naming what
    is wrong."""
    import yaml  # type: ignore[import-untyped]  # (no stubs installed)

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:  # its message quotes nothing of the file
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except yaml.YAMLError as exc:  # its message quotes the line (a key, maybe): the position only
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML ({getattr(exc, 'problem', None) or 'syntax error'}{where})") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty mapping of API key -> {{tenant, priority, quotas}}")
    keys: dict[str, KeyPolicy] = {}
    for i, (key, entry) in enumerate(data.items()):
        where = f"{path}: entry {i + 1}"  # never the key itself: it is a secret
        try:
            keys[check_key(key)] = _policy(entry)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return keys


def _policy(entry: object) -> KeyPolicy:
    if entry is None:
        return KeyPolicy()
    if not isinstance(entry, dict):
        raise ValueError(f"a key's policy must be a mapping of {', '.join(_FIELDS)}")
    unknown = sorted(str(k) for k in entry if k not in _FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    return KeyPolicy(**entry)


class _KeyState:
    """A key's policy and the state of its quotas (touched on the event loop only)."""

    __slots__ = ("in_flight", "last", "policy", "tokens")

    def __init__(self, policy: KeyPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self.tokens = policy.bucket_size
        self.last: float | None = None

    def refusal(self, now: float) -> APIError | None:
        """Take a slot and a bucket token, or the 429 saying which quota is spent."""
        policy = self.policy
        if policy.max_concurrent is not None and self.in_flight >= policy.max_concurrent:
            return _over_quota(f"this API key has {self.in_flight} requests in flight, its limit", 1)
        rate = policy.rate
        if rate is not None:
            size = policy.bucket_size
            if self.last is not None:
                self.tokens = min(size, self.tokens + (now - self.last) * rate)
            self.last = now
            if self.tokens < 1.0:
                wait = math.ceil((1.0 - self.tokens) / rate)
                return _over_quota(f"this API key is over its rate of {rate:g} requests per second", wait)
            self.tokens -= 1.0
        self.in_flight += 1
        return None


def _over_quota(message: str, retry_after_s: int) -> APIError:
    retry = str(max(1, retry_after_s))
    return APIError(429, f"{message}; retry later", code="rate_limit_exceeded", headers={"Retry-After": retry})


class KeyRing:
    """The configured keys, looked up in constant time (see the module docstring)."""

    def __init__(self, keys: Mapping[str, KeyPolicy]) -> None:
        self._entries = [(_digest(check_key(k).encode("ascii")), _KeyState(p)) for k, p in keys.items()]

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, presented: bytes) -> _KeyState | None:
        digest = _digest(presented)
        found = None
        for known, state in self._entries:  # every entry, match or not
            if hmac.compare_digest(known, digest):
                found = state
        return found


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


def bearer_token(headers: Headers) -> bytes | None:
    """The key of ``Authorization: Bearer KEY`` as raw bytes; None without one."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("latin-1")  # the header's bytes, as they came


def is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == JSON_TYPE


class Gate:
    """The ASGI middleware of the module docstring: 401, 415 and per-key 429 before any route."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Mapping[str, KeyPolicy] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.keys = KeyRing(keys) if keys else None
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        guarded = scope["path"].startswith(GUARDED_PREFIX)
        state: _KeyState | None = None
        if guarded and self.keys is not None:
            token = bearer_token(headers)
            state = self.keys.find(token) if token is not None else None
            if state is None:
                await _answer(_unauthorized(token is not None), scope, receive, send)
                return
        post = scope["method"] == "POST"
        if post and not is_json(headers.get("content-type")):
            await _answer(_unsupported(headers.get("content-type")), scope, receive, send)
            return
        if state is None:
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[_STATE_KEY] = state.policy
        if not post:  # quotas count generation requests only
            await self.app(scope, receive, send)
            return
        refusal = state.refusal(self._clock())
        if refusal is not None:
            await _answer(refusal, scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)


def _unauthorized(presented: bool) -> APIError:
    message = "invalid API key" if presented else "missing API key: send it in the header 'Authorization: Bearer <key>'"
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _unsupported(content_type: str | None) -> APIError:
    got = "no Content-Type" if content_type is None else f"Content-Type {content_type[:100]!r}"
    return APIError(
        415,
        f"the request body must be JSON sent with 'Content-Type: {JSON_TYPE}'; got {got}",
        code="unsupported_media_type",
    )


# -- what a route reads -----------------------------------------------------------------------
def key_policy(request: Request) -> KeyPolicy | None:
    """The policy of the request's API key (None without keys configured)."""
    policy = request.scope.get("state", {}).get(_STATE_KEY)
    return policy if isinstance(policy, KeyPolicy) else None


def request_tenant(request: Request, *, trust_header: bool) -> str | None:
    """The tenant the scheduler sees: X-Tenant when trusted and given, else the key's (or none)."""
    if trust_header:
        value = request.headers.get(TENANT_HEADER)
        if value is not None:
            if not TENANT_PATTERN.fullmatch(value):
                raise bad("the X-Tenant header must be 1 to 128 characters of letters, digits and ._:@/+-", "X-Tenant")
            return value
    policy = key_policy(request)
    return policy.tenant if policy is not None else None


def request_priority(request: Request, asked: int | None) -> int:
    """The priority the scheduler sees: what the request asked for (default 0), no more urgent
    (no lower) than its key's priority, which is also the default."""
    policy = key_policy(request)
    floor = policy.priority if policy is not None else None
    if floor is None:
        return asked if asked is not None else 0
    return floor if asked is None else max(asked, floor)
