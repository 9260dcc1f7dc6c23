"""The one step loop, shared by the simulator, the offline engine and the server.

`EngineCore` (`core`) runs schedule -> execute -> update -> outputs over a pluggable `Clock`
(`clock`: virtual, priced by a cost model; or wall) and a pluggable `Executor` (`executor`).
Request intake (`intake`), the one `SamplingParams` (`params`), incremental detokenization and
stop strings (`text`) and step observers (`observe`) live here once.

Layering: the standard library and `contbatch.core` only (no torch, numpy, asyncio).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contbatch.lazy import lazy_names
from contbatch.loop.clock import Clock, StepPricer, VirtualClock, WallClock
from contbatch.loop.core import EngineCore, Flight, RequestOutput
from contbatch.loop.executor import Executor, StepError
from contbatch.loop.observe import StepObserver, StepRecord, StepTotals

if TYPE_CHECKING:
    from contbatch.loop.intake import Intake, IntakeError
    from contbatch.loop.params import GREEDY, SamplingParams
    from contbatch.loop.text import TextStream

# intake, sampling parameters and text, imported on first use: the simulator needs none of them
_LAZY = {
    "Intake": "intake",
    "IntakeError": "intake",
    "GREEDY": "params",
    "SamplingParams": "params",
    "TextStream": "text",
}


__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "GREEDY",
    "Clock",
    "EngineCore",
    "Executor",
    "Flight",
    "Intake",
    "IntakeError",
    "RequestOutput",
    "SamplingParams",
    "StepError",
    "StepObserver",
    "StepPricer",
    "StepRecord",
    "StepTotals",
    "TextStream",
    "VirtualClock",
    "WallClock",
]
