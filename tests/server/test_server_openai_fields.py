"""The OpenAI surface beyond the basics: `n`, `logprobs`/`top_logprobs`, `echo` (with prompt
logprobs: lm-evaluation-harness's log-likelihood request), penalties, `min_p`, `top_k`,
`logit_bias`, 64-bit seeds, `GET /v1/models/{id}` and `HEAD /health`.

The engine backend (the demo model) implements them all, through the official `openai` client;
its logprobs equal transformers' log-softmax. The sim backend implements `n` and `echo` of a text
prompt and refuses, with a 400 naming the field, what it cannot honour without a model."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from contbatch.core import PRESETS
from contbatch.engine.demo import ensure_demo_model
from contbatch.server.backends import BackendOptions, make_backend
from server.harness import MODEL as SIM_MODEL
from server.harness import RunningServer, start_server

MODEL = "demo"
PROMPT = "the cat sat on the mat and the dog sat on the log"


@pytest.fixture(scope="module")
def engine_server() -> Iterator[RunningServer]:
    backend = make_backend("engine", PRESETS["engine"], BackendOptions(served_model_name=MODEL))
    server = start_server(backend=backend)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sim_server() -> Iterator[RunningServer]:
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def oai(engine_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ensure_demo_model(), dtype=torch.float32).eval()


def hf_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax [len, vocab]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def sse_chunks(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


# -- engine: n ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_n_choices_are_independent_and_seeded(oai: openai.OpenAI) -> None:
    def ask() -> Any:
        return oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=2**63 + 5,
            extra_body={"ignore_eos": True},
        )

    r = ask()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds s, s + 1, s + 2
    assert r.usage is not None and r.usage.completion_tokens == 18
    assert [c.text for c in ask().choices] == [c.text for c in r.choices]  # the seed reproduces every choice


@pytest.mark.slow
def test_n_streams_interleave_choices_by_index(engine_server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = sse_chunks(engine_server, "/v1/chat/completions", body)
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1]
    texts = []
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert choices[-1]["finish_reason"] == "length"
        texts.append("".join(c["delta"].get("content", "") for c in choices))
    assert texts[0] == texts[1]  # greedy: both choices alike
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


# -- engine: logprobs ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_completion_logprobs_equal_transformers(
    oai: openai.OpenAI, engine_server: RunningServer, hf_model: Any
) -> None:
    prompt = engine_server.client.prompt_ids(PROMPT)
    r = oai.completions.create(
        model=MODEL, prompt=list(prompt), max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    decode = engine_server.client.decode
    ids: list[int] = []  # transformers' greedy tokens, one by one
    for i in range(5):
        row = hf_logprobs(hf_model, list(prompt) + ids)[-1]
        token = int(row.argmax())
        ids.append(token)
        assert lp.tokens[i] == decode([token], skip_special_tokens=False)
        assert abs(lp.token_logprobs[i] - float(row[token])) < 1e-4
        top = lp.top_logprobs[i]
        values, top_ids = row.topk(3)
        assert len(top) == 3
        for t, v in zip(top_ids.tolist(), values.tolist(), strict=True):
            assert abs(top[decode([t], skip_special_tokens=False)] - v) < 1e-4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


@pytest.mark.slow
def test_echo_prompt_logprobs_as_lm_eval_asks(oai: openai.OpenAI, engine_server: RunningServer, hf_model: Any) -> None:
    prompt = list(engine_server.client.prompt_ids(PROMPT))
    want = hf_logprobs(hf_model, prompt)
    for max_tokens in (0, 1):
        r = oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True
        )
        choice = r.choices[0]
        lp = choice.logprobs
        assert lp is not None
        assert len(lp.tokens) == len(prompt) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert abs(lp.token_logprobs[i] - float(want[i - 1, prompt[i]])) < 1e-4
            assert len(lp.top_logprobs[i]) in (1, 2)  # the top token, plus the prompt's when it differs
        prompt_text = engine_server.client.decode(prompt)
        assert choice.text.startswith(prompt_text)
        assert r.usage is not None and r.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == prompt_text
    # lm-eval's is_greedy check: the top token of each continuation position
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert lp is not None
    last = lp.top_logprobs[-1]
    assert max(last, key=last.__getitem__) == lp.tokens[-1]


@pytest.mark.slow
def test_streaming_echo_sends_the_prompt_first(engine_server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 0, "stream": True}
    chunks = sse_chunks(engine_server, "/v1/completions", body)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    prompt_ids = engine_server.client.prompt_ids(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(prompt_ids) + 3


@pytest.mark.slow
def test_chat_logprobs_and_top_logprobs(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode("utf-8"))
    assert "".join(item.token for item in content) == r.choices[0].message.content


# -- engine: penalties and filters -----------------------------------------------------------------------
def _greedy(oai: openai.OpenAI, **extra: Any) -> tuple[str, list[str], list[float]]:
    body = {"ignore_eos": True, **extra.pop("extra_body", {})}
    r = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=extra.pop("temperature", 0), logprobs=0,
        extra_body=body, **extra,
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp is not None
    return r.choices[0].text, list(lp.tokens), list(lp.token_logprobs)


@pytest.mark.slow
def test_penalties_change_greedy_output(oai: openai.OpenAI) -> None:
    plain, tokens, _ = _greedy(oai)
    assert len(set(tokens)) < len(tokens)  # the random model repeats itself
    for extra in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 3.0}},
    ):
        text, penalized, _ = _greedy(oai, **extra)
        assert text != plain, extra
        assert len(set(penalized)) > len(set(tokens)), extra


@pytest.mark.slow
def test_logit_bias_min_p_and_top_k(oai: openai.OpenAI, engine_server: RunningServer) -> None:
    plain, _, _ = _greedy(oai)
    forced = 500
    _, tokens, logprobs = _greedy(oai, logit_bias={str(forced): 100})
    piece = engine_server.client.decode([forced], skip_special_tokens=False)
    assert tokens == [piece] * 12
    assert all(lp < -1.0 for lp in logprobs)  # raw logprobs: the bias is not in them
    # min_p 1 and top_k 1 leave only the most likely token: sampling is greedy
    assert _greedy(oai, temperature=1.0, seed=3, extra_body={"min_p": 1.0})[0] == plain
    assert _greedy(oai, temperature=1.0, seed=3, extra_body={"top_k": 1})[0] == plain
    assert _greedy(oai, temperature=1.0, seed=3)[0] != plain


@pytest.mark.slow
def test_values_that_round_to_zero_in_float32_sample_the_top_token(oai: openai.OpenAI) -> None:
    plain, _, _ = _greedy(oai)
    assert _greedy(oai, temperature=1e-46)[0] == plain  # below 1e-5: greedy (vLLM's rule)
    assert _greedy(oai, temperature=1.0, top_p=1e-46, seed=1)[0] == plain  # the top token always stays


@pytest.mark.slow
def test_a_speculative_engine_server_gives_the_same_tokens(oai: openai.OpenAI) -> None:
    config = dataclasses.replace(PRESETS["engine"], num_speculative_tokens=3)
    server = start_server(backend=make_backend("engine", config, BackendOptions(served_model_name=MODEL)))
    try:
        spec = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for n in (1, 2):
            want = _greedy(oai, n=n)
            got = _greedy(spec, n=n)
            assert got[0] == want[0] and got[1] == want[1]
            assert got[2] == pytest.approx(want[2], abs=1e-4)
        assert server.scheduler.stats.num_accepted_draft_tokens > 0
    finally:
        server.stop()


@pytest.mark.slow
def test_models_card_and_head_health(engine_server: RunningServer) -> None:
    card = engine_server.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = engine_server.get("/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    with httpx.Client(timeout=10) as http:
        head = http.head(engine_server.base_url + "/health")
    assert head.status_code == 200 and head.content == b""


# -- sim ---------------------------------------------------------------------------------------------------
def test_sim_n_choices(sim_server: RunningServer) -> None:
    oai = openai.OpenAI(base_url=sim_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = oai.completions.create(model=SIM_MODEL, prompt="a b c", n=3, max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.text == " tok" * 4 for c in r.choices)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 12)
    # with a seed each choice draws its own end of sequence (seed + index)
    r = oai.completions.create(model=SIM_MODEL, prompt="a b c", n=4, max_tokens=2000, seed=7)
    lengths = [len(c.text) // len(" tok") for c in r.choices]
    assert len(set(lengths)) > 1 and all(c.finish_reason == "stop" for c in r.choices)


def test_sim_streaming_n(sim_server: RunningServer) -> None:
    body = {"model": SIM_MODEL, "prompt": "x", "n": 2, "max_tokens": 3, "ignore_eos": True, "stream": True}
    chunks = sse_chunks(sim_server, "/v1/completions", body)
    texts: dict[int, str] = {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: " tok" * 3, 1: " tok" * 3}


def test_sim_echo_of_a_text_prompt(sim_server: RunningServer) -> None:
    body = {"model": SIM_MODEL, "prompt": "hello world", "max_tokens": 2, "echo": True, "ignore_eos": True}
    r = sim_server.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world tok tok"
    r = sim_server.post("/v1/completions", json={**body, "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world"
    assert r.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 2),
        ("logprobs", 0),
        ("top_k", 5),
        ("min_p", 0.1),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("repetition_penalty", 1.2),
        ("logit_bias", {"5": 3}),
    ],
)
def test_sim_refuses_what_it_cannot_honour(sim_server: RunningServer, field: str, value: object) -> None:
    r = sim_server.post("/v1/completions", json={"model": SIM_MODEL, "prompt": "x", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "sim backend" in error["message"] and "no model" in error["message"]


def test_sim_refusals_on_chat_and_echo_of_token_ids(sim_server: RunningServer) -> None:
    chat = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True}
    r = sim_server.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = sim_server.post("/v1/completions", json={"model": SIM_MODEL, "prompt": [1, 2], "max_tokens": 1, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_sim_accepts_the_defaults_of_refused_fields(sim_server: RunningServer) -> None:
    body = {
        "model": SIM_MODEL,
        "prompt": "x",
        "max_tokens": 2,
        "top_k": -1,
        "min_p": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "repetition_penalty": 1,
        "logit_bias": {},
        "logprobs": None,
        "seed": 2**64 - 1,
    }
    assert sim_server.post("/v1/completions", json=body).status_code == 200


def test_max_tokens_beyond_the_kv_cache_names_max_tokens(sim_server: RunningServer) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**31 - 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**31 - 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**31 - 1}),
    ):
        r = sim_server.post(path, json={"model": SIM_MODEL, **body})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == next(k for k in body if k.startswith("max_")), r.text


def test_sim_models_card_and_head_health(sim_server: RunningServer) -> None:
    assert sim_server.get(f"/v1/models/{SIM_MODEL}").json()["id"] == SIM_MODEL
    assert sim_server.get("/v1/models/other").status_code == 404
    with httpx.Client(timeout=10) as http:
        assert http.head(sim_server.base_url + "/health").status_code == 200
