"""The offline API: `LLM(...).generate(prompts, params)` on the engine loop.

All prompts are queued at once and the loop steps until every one has finished, so they share
batches exactly as concurrent requests would. Results come back in prompt order, each with its
text, token ids, finish reason and timeline (arrival, first token, finish: the metrics library
computes TTFT, TPOT and E2E from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard, cast

from contbatch.core import FinishReason, Timeline
from contbatch.core.outputs import TokenLogprobs
from contbatch.engine.llm_engine import EngineConfig, LLMEngine
from contbatch.loop.params import SamplingParams


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    finish_detail: str  # why, for rejected or failed requests
    num_prompt_tokens: int
    timeline: Timeline
    logprobs: tuple[TokenLogprobs, ...] = ()  # with SamplingParams.logprobs: one per output token
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # with SamplingParams.prompt_logprobs


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None) -> None:
        """`model`: a local checkpoint directory (None: the demo model). `config` for the rest."""
        base = config or EngineConfig()
        self.engine = LLMEngine(base if model is None else _with_model(base, model))

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        batch: list[str | list[int]]
        if isinstance(prompts, str) or _is_token_list(prompts):
            batch = [prompts]  # one prompt: text, or a list of token ids
        else:
            batch = list(cast("Sequence[str | list[int]]", prompts))  # several prompts
        per_prompt = _params_for(batch, params)
        requests = [self.engine.add_request(p, sp) for p, sp in zip(batch, per_prompt, strict=True)]
        texts = {r.request_id: "" for r in requests}
        logprobs: dict[str, list[TokenLogprobs]] = {r.request_id: [] for r in requests}
        prompt_logprobs: dict[str, tuple[TokenLogprobs | None, ...]] = {}
        outputs = self.engine.core.take_outputs()  # rejections, at once
        while self.engine.has_unfinished():
            outputs += self.engine.step()
        for output in outputs + self.engine.core.take_outputs():
            texts[output.request_id] += output.text
            logprobs[output.request_id].extend(output.logprobs)
            if output.prompt_logprobs is not None:
                prompt_logprobs[output.request_id] = output.prompt_logprobs
        return [
            CompletionOutput(
                r.request_id,
                texts[r.request_id],
                tuple(r.output_token_ids),
                r.finish_reason or FinishReason.ERROR,
                r.finish_detail,
                r.num_prompt_tokens,
                r.timeline,
                tuple(logprobs[r.request_id]),
                prompt_logprobs.get(r.request_id),
            )
            for r in requests
        ]


def _with_model(config: EngineConfig, model: str) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, model=model)


def _is_token_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _params_for(
    batch: list[str | list[int]], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(batch)
    if len(params) != len(batch):
        raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
    return list(params)
