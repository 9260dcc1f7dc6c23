"""Work priced by a replica's own cost model, for the `least_work` router and the `work` scorer
(`contbatch.routing.WorkPricer`): the routing core stays free of cost models, the simulator
passes this in.

The price of (prefill tokens, decode tokens, decoding requests) on a replica is the time its cost
model gives for: the prefill tokens as full steps of its token budget plus one step of the rest,
each a prompt chunk attending to itself; and the decode tokens shared by the decoding requests
(at least one), as that many steady decode steps of that batch at `DECODE_CONTEXT` positions per
request. Step prices are memoized per replica kind, so routing costs no cost-model call once warm.
"""

from __future__ import annotations

from collections.abc import Mapping

from contbatch.core import SchedulerConfig
from contbatch.core.outputs import ScheduledChunk, build_output
from contbatch.routing import WorkPricer
from contbatch.sim.cost import CostModel
from contbatch.sim.skip_ahead import decode_shape

DECODE_CONTEXT = 1024  # positions each decoding request is taken to attend to


class PoolPricer:
    """Step prices of one kind of replica (a cost model and a token budget), memoized."""

    def __init__(self, cost: CostModel, config: SchedulerConfig) -> None:
        self.cost = cost
        self.budget = max(1, config.max_num_batched_tokens)
        self._prefill: dict[int, float] = {}
        self._decode: dict[int, float] = {}

    def prefill_step(self, num_tokens: int) -> float:
        price = self._prefill.get(num_tokens)
        if price is None:
            chunk = ScheduledChunk("work", 0, num_tokens, True, True)
            price = self._prefill[num_tokens] = self.cost.step_time(build_output(0, [chunk]))
        return price

    def decode_step(self, batch: int) -> float:
        price = self._decode.get(batch)
        if price is None:
            price = self._decode[batch] = self.cost.step_time(decode_shape(0, batch, batch * DECODE_CONTEXT, 0))
        return price

    def __call__(self, prefill_tokens: int, decode_tokens: int, num_decoding: int) -> float:
        full, rest = divmod(prefill_tokens, self.budget)
        time = full * self.prefill_step(self.budget) + (self.prefill_step(rest) if rest else 0.0)
        if decode_tokens > 0:
            batch = max(1, num_decoding)
            time += decode_tokens / batch * self.decode_step(batch)
        return time


def work_pricer(pricers: Mapping[str, PoolPricer]) -> WorkPricer:
    """A `WorkPricer` over replicas whose id maps to their kind's pricer (`pricers` may grow as
    replicas are added)."""

    def price(replica_id: str, prefill_tokens: int, decode_tokens: int, num_decoding: int) -> float:
        return pricers[replica_id](prefill_tokens, decode_tokens, num_decoding)

    return price
