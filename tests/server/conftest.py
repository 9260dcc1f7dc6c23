"""The server fixtures (`make_server`, `server`) live in `server.harness`, shared with other suites."""

from __future__ import annotations

from server.harness import make_server, server

__all__ = ["make_server", "server"]
