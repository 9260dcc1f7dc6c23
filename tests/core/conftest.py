"""Shared test support for `contbatch.core`.

The helpers that drive a scheduler by hand (`step`, `run_to_end`, `add`/`admit`, `sampled` /
`accept_all` / `accept_none`, `scheduled_ids`, `held`) live once in `drive.py`, beside this file,
as plain functions: tests and their module-level scenario builders call them with arguments.
This conftest has pytest rewrite `drive.py`'s asserts (as it does a test module's), so a helper's
failing assert reports its values; it must run before a test module imports `drive`, which a
conftest does.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite(f"{__name__.rpartition('.')[0]}.drive" if "." in __name__ else "drive")
