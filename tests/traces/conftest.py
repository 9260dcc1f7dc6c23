"""Fixtures for the trace tests: every file is written under pytest's tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._helpers import WriteFile


@pytest.fixture
def write_file(tmp_path: Path) -> WriteFile:
    """Write ``text`` verbatim (no newline translation) to ``tmp_path / name``."""

    def write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_bytes(text.encode("utf-8"))
        return path

    return write
