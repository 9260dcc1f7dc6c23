"""Per-step budgets as small objects with `try_consume` / `refund`.

Invariant: 0 <= remaining <= limit at every moment; `try_consume` either takes all it is asked
for and returns True, or takes nothing and returns False.
"""

from __future__ import annotations


class TokenBudget:
    __slots__ = ("limit", "remaining")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.remaining = limit

    @property
    def exhausted(self) -> bool:
        return self.remaining == 0

    def try_consume(self, num_tokens: int) -> bool:
        if num_tokens > self.remaining:
            return False
        self.remaining -= num_tokens
        return True

    def refund(self, num_tokens: int) -> None:
        if self.remaining + num_tokens > self.limit:
            raise ValueError(f"refund of {num_tokens} would exceed the budget limit {self.limit}")
        self.remaining += num_tokens
