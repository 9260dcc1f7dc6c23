"""The official `openai` client against the sim backend: completions and chat, streaming or not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from contbatch.loop import StepObserver
from server.harness import MODEL, RunningServer


@pytest.fixture
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_completion(oai: openai.OpenAI) -> None:
    r = oai.completions.create(
        model=MODEL, prompt="the cat sat on a mat", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].text == " tok" * 5 and r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 5, 11)


def test_completion_with_token_id_prompt(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 2


def test_completion_default_max_tokens_is_16(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_streaming_completion_with_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="one two three",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == " tok" * 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 4)  # one, two: 1 each; three: 2


def test_chat(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == " tok" * 3
    # the sim counts ceil(bytes / 4) per word: be 1, brief 2, hello 2, there 2
    assert r.usage is not None and r.usage.prompt_tokens == 7
    assert r.usage.completion_tokens == 3


def test_chat_content_parts_and_max_tokens(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}],
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None and r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2


def test_streaming_chat_with_continuous_usage(server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks: list[dict[str, Any]] = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": " tok"}
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 1 + 4


def test_stop_string_ends_with_stop(oai: openai.OpenAI) -> None:
    r = oai.completions.create(
        model=MODEL, prompt="x", max_tokens=10, stop=["tok tok"], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == " " and r.choices[0].finish_reason == "stop"


def test_eos_is_a_deterministic_draw_unless_ignored(oai: openai.OpenAI) -> None:
    lengths = []
    for _ in range(2):
        r = oai.completions.create(model=MODEL, prompt="x", max_tokens=2000, seed=11)
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None
        lengths.append(r.usage.completion_tokens)
    assert lengths[0] == lengths[1] < 2000


def test_models_and_health(oai: openai.OpenAI, server: RunningServer) -> None:
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.get("/health").status_code == 200


def test_priority_and_tenant_reach_the_scheduler(server: RunningServer) -> None:
    seen: dict[str, Any] = {}

    class Spy(StepObserver):
        def on_finished(self, request: Any, final: object = None) -> None:
            seen["tenant"], seen["priority"] = request.tenant, request.priority

    server.client.driver.core.observers.append(Spy())
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": 3}
    r = server.post("/v1/completions", json=body, headers={"X-Tenant": "team-a"})
    assert r.status_code == 200
    server.wait_idle()
    assert seen == {"tenant": "team-a", "priority": 3}
