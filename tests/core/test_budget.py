"""TokenBudget: all-or-nothing `try_consume`, bounded `refund`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contbatch.core.budget import TokenBudget


def test_consume_and_refund() -> None:
    budget = TokenBudget(8)
    assert budget.remaining == 8 and not budget.exhausted
    assert budget.try_consume(5)
    assert budget.remaining == 3
    assert not budget.try_consume(4)  # all or nothing
    assert budget.remaining == 3
    assert budget.try_consume(3)
    assert budget.exhausted
    assert budget.try_consume(0)  # nothing asked, nothing taken
    assert not budget.try_consume(1)
    budget.refund(2)
    assert budget.remaining == 2 and not budget.exhausted


def test_refund_beyond_the_limit_raises() -> None:
    budget = TokenBudget(4)
    assert budget.try_consume(1)
    with pytest.raises(ValueError, match="exceed the budget limit 4"):
        budget.refund(2)
    assert budget.remaining == 3
    budget.refund(1)
    assert budget.remaining == 4


@settings(max_examples=2 * settings().max_examples, derandomize=True, deadline=None)
@given(
    limit=st.integers(0, 50),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=30),
)
def test_remaining_stays_within_bounds(limit: int, ops: list[tuple[bool, int]]) -> None:
    budget = TokenBudget(limit)
    for consume, n in ops:
        before = budget.remaining
        if consume:
            ok = budget.try_consume(n)
            assert ok == (n <= before)
            assert budget.remaining == (before - n if ok else before)
        elif before + n <= limit:
            budget.refund(n)
            assert budget.remaining == before + n
        else:
            with pytest.raises(ValueError):
                budget.refund(n)
            assert budget.remaining == before
        assert 0 <= budget.remaining <= limit
        assert budget.exhausted == (budget.remaining == 0)
