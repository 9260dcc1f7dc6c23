"""The server fixtures (`make_server`) and the gateway's (`make_gateway`, `serve_app`)."""

from __future__ import annotations

from server.harness import make_server

from gateway.harness import make_gateway, serve_app

__all__ = ["make_gateway", "make_server", "serve_app"]
