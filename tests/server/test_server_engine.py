"""The official `openai` client against the real engine backend (the built-in demo model):
completions and chat, streaming and not; greedy output equals the offline engine's."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from contbatch.core import PRESETS
from contbatch.engine.api import LLM
from contbatch.loop.params import SamplingParams
from contbatch.server.backends import BackendOptions, make_backend
from server.harness import RunningServer, start_server

MODEL = "demo"


@pytest.fixture(scope="module")
def engine_server() -> Iterator[RunningServer]:
    backend = make_backend("engine", PRESETS["engine"], BackendOptions(served_model_name=MODEL))
    server = start_server(backend=backend)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def oai(engine_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_completion_greedy_equals_the_offline_engine(oai: openai.OpenAI) -> None:
    r = oai.completions.create(
        model=MODEL, prompt="the cat sat on", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    offline = LLM().generate("the cat sat on", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert r.choices[0].text == offline.text and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 6


@pytest.mark.slow
def test_streaming_chat_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_completion_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.slow
def test_models_and_a_prompt_beyond_the_context_is_refused(oai: openai.OpenAI, engine_server: RunningServer) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=4)
    assert engine_server.get("/health").status_code == 200
