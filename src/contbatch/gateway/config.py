"""The gateway's configuration: its backends and every limit, checked once.

A backend is an OpenAI-compatible server given by its base URL (``http://10.0.0.1:8000``; a
trailing ``/`` or ``/v1`` is dropped), optionally named (``NAME=URL``); the name labels the
gateway's metrics and is the replica id its router sees (default: ``host:port``). Nothing here
assumes one host: backends may be anywhere the gateway can reach.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from contbatch.server.auth import KeyPolicy, check_key

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@/+-")


class GatewayConfigError(ValueError):
    """A backend or a limit is invalid; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str  # the replica id routers see and the metrics' `backend` label
    url: str  # base URL: scheme, host, port (and a path prefix), no trailing slash, no /v1


def parse_backend(text: str) -> BackendSpec:
    """``URL`` or ``NAME=URL`` -> a `BackendSpec` (GatewayConfigError if malformed)."""
    name, sep, url = text.strip().partition("=")
    if not sep or "://" in name:  # no name given (an "=" in the URL's query does not name it)
        name, url = "", text.strip()
    url = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GatewayConfigError(f"backend {text!r}: expected http(s)://HOST[:PORT], optionally NAME=URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise GatewayConfigError(f"backend {text!r}: a backend URL takes no query, fragment or credentials")
    try:
        port = parts.port
    except ValueError:
        raise GatewayConfigError(f"backend {text!r}: bad port") from None
    name = name.strip() or (f"{parts.hostname}:{port}" if port is not None else parts.hostname)
    if not set(name) <= NAME_CHARS or len(name) > 128:
        raise GatewayConfigError(f"backend name {name!r}: 1 to 128 letters, digits and ._:@/+-")
    return BackendSpec(name, url)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    backends: tuple[BackendSpec, ...]
    router: str = "least_outstanding"  # a `contbatch.routing` spec
    health_interval_s: float = 2.0  # GET /health on every backend this often (0: never; all stay in rotation)
    health_timeout_s: float = 1.0  # a check not answered by then failed
    unhealthy_after: int = 1  # consecutive failed checks that take a backend out of the rotation
    healthy_after: int = 1  # consecutive good checks that bring it back
    scrape_interval_s: float = 1.0  # GET /metrics this often (0: never; the gateway's own counts only)
    retries: int = 2  # other backends tried after a failure before any byte reached the client
    connect_timeout_s: float = 5.0  # to connect to a backend (a timeout is retried elsewhere)
    read_timeout_s: float = 600.0  # between two reads of a backend's answer
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    body_timeout_s: float | None = 30.0  # a request body not in by then: 408
    default_max_tokens: int = 1024  # a chat request's output limit when it gives none (routing estimate)
    chars_per_token: float = 4.0  # prompt tokens are estimated as characters / this (the gateway does not tokenize)
    prefix_block_chars: int = 64  # characters per prefix key (routers that read prompt prefixes)
    upstream_api_key: str | None = None  # sent to the backends as `Authorization: Bearer KEY`
    api_keys: Mapping[str, KeyPolicy] | None = None  # the gateway's own keys (`contbatch.server.auth`)
    trust_tenant_header: bool = False  # honour a client's X-Tenant (else the key's tenant, or none)

    def check(self) -> GatewayConfig:
        """Self, validated (GatewayConfigError naming the first bad field)."""
        self._check_backends()
        for field, value in (
            ("health_interval_s", self.health_interval_s),
            ("scrape_interval_s", self.scrape_interval_s),
        ):
            _at_least(field, value, 0.0)
        for field, value in (
            ("health_timeout_s", self.health_timeout_s),
            ("connect_timeout_s", self.connect_timeout_s),
            ("read_timeout_s", self.read_timeout_s),
            ("chars_per_token", self.chars_per_token),
        ):
            if not (math.isfinite(value) and value > 0):
                raise GatewayConfigError(f"{field} must be > 0, got {value}")
        if self.body_timeout_s is not None:
            _at_least("body_timeout_s", self.body_timeout_s, 0.0)
        for field, count, low in (
            ("unhealthy_after", self.unhealthy_after, 1),
            ("healthy_after", self.healthy_after, 1),
            ("retries", self.retries, 0),
            ("max_body_bytes", self.max_body_bytes, 1),
            ("default_max_tokens", self.default_max_tokens, 1),
            ("prefix_block_chars", self.prefix_block_chars, 1),
        ):
            if count < low:
                raise GatewayConfigError(f"{field} must be >= {low}, got {count}")
        if self.upstream_api_key is not None:
            try:
                check_key(self.upstream_api_key)
            except ValueError as exc:
                raise GatewayConfigError(f"upstream API key: {exc}") from None
        return self

    def _check_backends(self) -> None:
        if not self.backends:
            raise GatewayConfigError("at least one backend is needed")
        names = [b.name for b in self.backends]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise GatewayConfigError(f"backend name {dup[0]!r} is given twice (name them: NAME=URL)")


def _at_least(field: str, value: float, low: float) -> None:
    if not (math.isfinite(value) and value >= low):
        raise GatewayConfigError(f"{field} must be >= {low:g}, got {value}")


def backends_of(texts: Sequence[str]) -> tuple[BackendSpec, ...]:
    return tuple(parse_backend(t) for t in texts)
