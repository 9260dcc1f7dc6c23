"""Bad input gets a clear 4xx with OpenAI error JSON naming the field, and the server stays healthy,
on both backends: the sim (no model) and the engine (the built-in demo model).

Each case states what both backends answer, and the engine's answer where it differs (`engine=`):
the sim refuses the fields it has no model for (logprobs, top_k, min_p, penalties, logit_bias:
`contbatch.server.backends.sim.UNSUPPORTED_FIELDS`), which the engine implements; and a prompt
that has no token on the sim (empty or blank text: its tokens are the words) is one token on the
engine (its tokenizer adds BOS, its chat template adds the role markers). A few cases are accepted
on purpose (status 200): the boundaries and the decisions they pin down (unknown fields are
ignored, as vLLM does; a known feature that is not implemented is refused when asked for).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import httpx
import pytest

from contbatch.core import PRESETS, SchedulerConfig
from contbatch.server.backends import Backend, BackendOptions, make_backend
from contbatch.server.serving import ServerConfig
from server.harness import MODEL, RunningServer, sim_backend, start_server

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMIT = 64 * 1024
MAX_MODEL_LEN = 4096
ACCEPTED = (200, None)
NO_TYPE = "<none>"  # a header value: send no Content-Type at all
BACKENDS = ("sim", "engine")


def completion(**changes: Any) -> dict[str, Any]:
    body = dict(OK)
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def chat(**changes: Any) -> dict[str, Any]:
    body = dict(CHAT)
    body.update(changes)
    return body


def user(content: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": content}])


_DROP = object()


class Case(NamedTuple):
    name: str
    path: str
    body: Any  # a dict: sent as JSON; bytes: sent as they are (as application/json unless headers say); None: none
    headers: dict[str, str]
    status: int  # both backends' status ...
    param: str | None  # ... and the error's param (None: not checked)
    engine: tuple[int, str | None] | None = None  # the engine's (status, param) where it differs (see why at the case)
    method: str = "POST"

    def expected(self, backend: str) -> tuple[int, str | None]:
        return self.engine if backend == "engine" and self.engine is not None else (self.status, self.param)


def bias(n: int) -> dict[str, float]:
    return {str(1000 + i): 1.0 for i in range(n)}


CASES: list[Case] = [
    Case("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', {}, 400, None),
    Case("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, None),
    Case("not an object", "/v1/completions", b"[1, 2, 3]", {}, 400, None),
    Case("empty body", "/v1/completions", b"", {}, 400, None),
    Case("NaN literal", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', {}, 400, None),
    Case("deep nesting", "/v1/completions", b"[" * 20_000 + b"]" * 20_000, {}, 400, None),
    Case("oversized body", "/v1/completions", {"prompt": "a " * LIMIT}, {}, 413, None),
    Case("missing prompt", "/v1/completions", completion(prompt=_DROP), {}, 400, "prompt"),
    Case("prompt is a number", "/v1/completions", completion(prompt=5), {}, 400, "prompt"),
    # An empty or blank prompt has no token on the sim (its tokens are the words) and is refused;
    # the engine's tokenizer adds BOS, so the prompt is one token (plus whitespace ones) and valid,
    # as for transformers and vLLM.
    Case("empty prompt", "/v1/completions", completion(prompt=""), {}, 400, "prompt", engine=ACCEPTED),
    Case("blank prompt", "/v1/completions", completion(prompt="   \n "), {}, 400, "prompt", engine=ACCEPTED),
    Case("batched prompts", "/v1/completions", completion(prompt=["a", "b"]), {}, 400, "prompt"),
    Case("negative token id", "/v1/completions", completion(prompt=[1, -1]), {}, 400, "prompt"),
    Case("token id beyond vocab", "/v1/completions", completion(prompt=[10**9]), {}, 400, "prompt"),
    Case("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', {}, 400, "prompt"),
    Case("max_tokens 0", "/v1/completions", completion(max_tokens=0), {}, 400, "max_tokens"),
    Case("max_tokens string", "/v1/completions", completion(max_tokens="10"), {}, 400, "max_tokens"),
    Case("max_tokens float", "/v1/completions", completion(max_tokens=1.5), {}, 400, "max_tokens"),
    Case("max_tokens bool", "/v1/completions", completion(max_tokens=True), {}, 400, "max_tokens"),
    Case("beyond max_model_len", "/v1/completions", completion(max_tokens=5000), {}, 400, "max_tokens"),
    Case("temperature 3", "/v1/completions", completion(temperature=3), {}, 400, "temperature"),
    Case("temperature text", "/v1/completions", completion(temperature="hot"), {}, 400, "temperature"),
    Case("top_p 0", "/v1/completions", completion(top_p=0), {}, 400, "top_p"),
    Case("n 0", "/v1/completions", completion(n=0), {}, 400, "n"),
    Case("n 129", "/v1/completions", completion(n=129), {}, 400, "n"),
    Case("n text", "/v1/completions", completion(n="2"), {}, 400, "n"),
    Case("n float", "/v1/completions", completion(n=2.5), {}, 400, "n"),
    Case("chat n 0", "/v1/chat/completions", chat(n=0), {}, 400, "n"),
    Case("best_of 3", "/v1/completions", completion(best_of=3), {}, 400, "best_of"),
    Case("echo text", "/v1/completions", completion(echo="yes"), {}, 400, "echo"),
    Case("echo on chat", "/v1/chat/completions", chat(echo=True), {}, 400, "echo"),
    Case("max_tokens 0 without echo", "/v1/completions", completion(max_tokens=0, echo=False), {}, 400, "max_tokens"),
    Case("max_tokens -1 with echo", "/v1/completions", completion(max_tokens=-1, echo=True), {}, 400, "max_tokens"),
    Case("max_tokens 2**31-1", "/v1/completions", completion(max_tokens=2**31 - 1), {}, 400, "max_tokens"),
    Case("max_tokens 2**31", "/v1/completions", completion(max_tokens=2**31), {}, 400, "max_tokens"),
    Case("chat max_tokens 2**31-1", "/v1/chat/completions", chat(max_tokens=2**31 - 1), {}, 400, "max_tokens"),
    Case("logprobs -1", "/v1/completions", completion(logprobs=-1), {}, 400, "logprobs"),
    Case("logprobs 21", "/v1/completions", completion(logprobs=21), {}, 400, "logprobs"),
    Case("logprobs true on completions", "/v1/completions", completion(logprobs=True), {}, 400, "logprobs"),
    Case("logprobs float", "/v1/completions", completion(logprobs=1.5), {}, 400, "logprobs"),
    Case("top_logprobs on completions", "/v1/completions", completion(top_logprobs=2), {}, 400, "top_logprobs"),
    Case("chat logprobs number", "/v1/chat/completions", chat(logprobs=5), {}, 400, "logprobs"),
    Case("chat top_logprobs 21", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    Case("chat top_logprobs -1", "/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), {}, 400, "top_logprobs"),
    Case("chat top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=3), {}, 400, "top_logprobs"),
    Case("logit_bias list", "/v1/completions", completion(logit_bias=[1, 2]), {}, 400, "logit_bias"),
    Case("logit_bias non-integer key", "/v1/completions", completion(logit_bias={"abc": 1}), {}, 400, "logit_bias"),
    Case("logit_bias negative key", "/v1/completions", completion(logit_bias={"-3": 1}), {}, 400, "logit_bias"),
    Case("logit_bias float key", "/v1/completions", completion(logit_bias={"1.5": 1}), {}, 400, "logit_bias"),
    Case("logit_bias huge key", "/v1/completions", completion(logit_bias={"9" * 5000: 1}), {}, 400, "logit_bias"),
    Case(
        "logit_bias key beyond vocab", "/v1/completions", completion(logit_bias={"10000000": 1}), {}, 400, "logit_bias"
    ),
    Case("logit_bias 101", "/v1/completions", completion(logit_bias={"5": 101}), {}, 400, "logit_bias"),
    Case("logit_bias -100.5", "/v1/completions", completion(logit_bias={"5": -100.5}), {}, 400, "logit_bias"),
    Case("logit_bias text value", "/v1/completions", completion(logit_bias={"5": "up"}), {}, 400, "logit_bias"),
    Case("logit_bias bool value", "/v1/completions", completion(logit_bias={"5": True}), {}, 400, "logit_bias"),
    Case(
        "chat logit_bias 1e400",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1e400}}',
        {},
        400,
        "logit_bias",
    ),
    Case("min_p 2", "/v1/completions", completion(min_p=2), {}, 400, "min_p"),
    Case("min_p -0.1", "/v1/completions", completion(min_p=-0.1), {}, 400, "min_p"),
    Case("min_p text", "/v1/completions", completion(min_p="low"), {}, 400, "min_p"),
    Case("top_k -2", "/v1/completions", completion(top_k=-2), {}, 400, "top_k"),
    Case("top_k float", "/v1/completions", completion(top_k=1.5), {}, 400, "top_k"),
    Case("top_k 2**31", "/v1/completions", completion(top_k=2**31), {}, 400, "top_k"),
    Case("repetition_penalty 0", "/v1/completions", completion(repetition_penalty=0), {}, 400, "repetition_penalty"),
    Case("repetition_penalty -1", "/v1/completions", completion(repetition_penalty=-1), {}, 400, "repetition_penalty"),
    Case(
        "repetition_penalty 1e-46",
        "/v1/completions",
        completion(repetition_penalty=1e-46),
        {},
        400,
        "repetition_penalty",
    ),
    Case(
        "repetition_penalty 101", "/v1/completions", completion(repetition_penalty=101), {}, 400, "repetition_penalty"
    ),
    Case("frequency_penalty -3", "/v1/completions", completion(frequency_penalty=-3), {}, 400, "frequency_penalty"),
    Case("frequency_penalty text", "/v1/completions", completion(frequency_penalty="x"), {}, 400, "frequency_penalty"),
    Case("chat presence_penalty 2.5", "/v1/chat/completions", chat(presence_penalty=2.5), {}, 400, "presence_penalty"),
    Case("seed 2**64", "/v1/completions", completion(seed=2**64), {}, 400, "seed"),
    Case("seed -2**63-1", "/v1/completions", completion(seed=-(2**63) - 1), {}, 400, "seed"),
    Case("seed float", "/v1/completions", completion(seed=1.5), {}, 400, "seed"),
    Case("chat seed 2**70", "/v1/chat/completions", chat(seed=2**70), {}, 400, "seed"),
    Case("stop number", "/v1/completions", completion(stop=5), {}, 400, "stop"),
    Case("too many stops", "/v1/completions", completion(stop=[f"s{i}" for i in range(17)]), {}, 400, "stop"),
    Case("empty stop", "/v1/completions", completion(stop=[""]), {}, 400, "stop"),
    Case("stream text", "/v1/completions", completion(stream="yes"), {}, 400, "stream"),
    Case(
        "stream_options without stream",
        "/v1/completions",
        completion(stream_options={"include_usage": True}),
        {},
        400,
        "stream_options",
    ),
    Case(
        "include_usage text",
        "/v1/completions",
        completion(stream=True, stream_options={"include_usage": "y"}),
        {},
        400,
        "include_usage",
    ),
    Case("ignore_eos text", "/v1/completions", completion(ignore_eos="no"), {}, 400, "ignore_eos"),
    Case("priority text", "/v1/completions", completion(priority="high"), {}, 400, "priority"),
    Case("seed text", "/v1/completions", completion(seed="x"), {}, 400, "seed"),
    Case("presence_penalty 5", "/v1/completions", completion(presence_penalty=5), {}, 400, "presence_penalty"),
    Case("model number", "/v1/completions", completion(model=123), {}, 400, "model"),
    Case("unknown model", "/v1/completions", completion(model="gpt-17"), {}, 404, "model"),
    Case("bad tenant header", "/v1/completions", completion(), {"X-Tenant": "a b"}, 400, "X-Tenant"),
    # admission and access (issue 15): not JSON, too long to tokenize, a tenant the server refuses
    Case("text/plain body", "/v1/completions", completion(), {"content-type": "text/plain"}, 415, None),
    Case(
        "form body", "/v1/completions", completion(), {"content-type": "application/x-www-form-urlencoded"}, 415, None
    ),
    Case(
        "multipart body", "/v1/chat/completions", chat(), {"content-type": "multipart/form-data; boundary=x"}, 415, None
    ),
    Case("text/json body", "/v1/completions", completion(), {"content-type": "text/json"}, 415, None),
    Case("empty content type", "/v1/chat/completions", chat(), {"content-type": ""}, 415, None),
    Case("raw text/plain body", "/v1/completions", b'{"prompt": "a"}', {"content-type": "text/plain"}, 415, None),
    Case("prompt beyond the context", "/v1/completions", completion(prompt="abcd " * 12_000), {}, 400, "prompt"),
    Case(
        "chat beyond the context, untokenized",
        "/v1/chat/completions",
        chat(messages=[{"role": "system", "content": "abcd " * 6_000}, {"role": "user", "content": "efgh " * 6_000}]),
        {},
        400,
        "messages",
    ),
    Case("long blank prompt", "/v1/completions", completion(prompt=" \n" * 10_000), {}, 400, "prompt"),
    Case("tenant header too long", "/v1/completions", completion(), {"X-Tenant": "t" * 129}, 400, "X-Tenant"),
    Case("empty tenant header", "/v1/completions", completion(), {"X-Tenant": ""}, 400, "X-Tenant"),
    Case("priority 2**31", "/v1/completions", completion(priority=2**31), {}, 400, "priority"),
    Case("chat without messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    Case("chat empty messages", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    Case("chat message not object", "/v1/chat/completions", chat(messages=["hi"]), {}, 400, "messages[0]"),
    Case(
        "chat bad role",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat image part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        {},
        400,
        "messages[0].content[0].type",
    ),
    Case(
        "chat content number",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": 7}]),
        {},
        400,
        "messages[0].content",
    ),
    Case("chat tools", "/v1/chat/completions", chat(tools=[{"type": "function"}]), {}, 400, "tools"),
    Case(
        "chat json response",
        "/v1/chat/completions",
        chat(response_format={"type": "json_object"}),
        {},
        400,
        "response_format",
    ),
    Case(
        "chat max_completion_tokens 0",
        "/v1/chat/completions",
        chat(max_completion_tokens=0),
        {},
        400,
        "max_completion_tokens",
    ),
    # -- numbers sent as strings ---------------------------------------------------------------
    Case("temperature as a numeric string", "/v1/completions", completion(temperature="0.5"), {}, 400, "temperature"),
    Case("top_p as a numeric string", "/v1/completions", completion(top_p="0.9"), {}, 400, "top_p"),
    Case("seed as a numeric string", "/v1/completions", completion(seed="42"), {}, 400, "seed"),
    Case("top_k as a numeric string", "/v1/completions", completion(top_k="5"), {}, 400, "top_k"),
    Case("logprobs as a numeric string", "/v1/completions", completion(logprobs="2"), {}, 400, "logprobs"),
    Case("best_of as a numeric string", "/v1/completions", completion(best_of="2"), {}, 400, "best_of"),
    Case(
        "chat presence_penalty as a string",
        "/v1/chat/completions",
        chat(presence_penalty="0.5"),
        {},
        400,
        "presence_penalty",
    ),
    Case(
        "chat max_completion_tokens as a string",
        "/v1/chat/completions",
        chat(max_completion_tokens="5"),
        {},
        400,
        "max_completion_tokens",
    ),
    # -- messages: nested wrong types, content parts, roles ----------------------------------------
    Case(
        "chat audio part",
        "/v1/chat/completions",
        user([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]),
        {},
        400,
        "messages[0].content[0].type",
    ),
    Case(
        "chat part of unknown type",
        "/v1/chat/completions",
        user([{"type": "hologram", "text": "x"}]),
        {},
        400,
        "messages[0].content[0].type",
    ),
    Case(
        "chat part without type",
        "/v1/chat/completions",
        user([{"text": "hi"}]),
        {},
        400,
        "messages[0].content[0].type",
    ),
    Case(
        "chat part text a number",
        "/v1/chat/completions",
        user([{"type": "text", "text": 5}]),
        {},
        400,
        "messages[0].content[0].text",
    ),
    Case("chat part a bare string", "/v1/chat/completions", user(["hi"]), {}, 400, "messages[0].content[0].type"),
    Case(
        "chat content a single part object",
        "/v1/chat/completions",
        user({"type": "text", "text": "hi"}),
        {},
        400,
        "messages[0].content",
    ),
    Case(
        "chat image part after a text part, second message",
        "/v1/chat/completions",
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:,"}}],
                },
            ]
        ),
        {},
        400,
        "messages[1].content[1].type",
    ),
    Case("chat user content null", "/v1/chat/completions", user(None), {}, 400, "messages[0].content"),
    Case(
        "chat message without role",
        "/v1/chat/completions",
        chat(messages=[{"content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat role a number",
        "/v1/chat/completions",
        chat(messages=[{"role": 1, "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat role in capitals",
        "/v1/chat/completions",
        chat(messages=[{"role": "USER", "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat legacy function role",
        "/v1/chat/completions",
        chat(messages=[{"role": "function", "name": "f", "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat empty role",
        "/v1/chat/completions",
        chat(messages=[{"role": "", "content": "x"}]),
        {},
        400,
        "messages[0].role",
    ),
    Case(
        "chat messages an object",
        "/v1/chat/completions",
        chat(messages={"role": "user", "content": "x"}),
        {},
        400,
        "messages",
    ),
    Case("chat messages a string", "/v1/chat/completions", chat(messages="hi"), {}, 400, "messages"),
    Case(
        "chat lone surrogate in content",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
        {},
        400,
        "messages[0].content",
    ),
    # An empty message has no token on the sim; on the engine the chat template's role markers are
    # the prompt (as transformers' apply_chat_template gives it).
    Case("chat empty content", "/v1/chat/completions", user(""), {}, 400, "messages", engine=ACCEPTED),
    Case("chat empty parts", "/v1/chat/completions", user([]), {}, 400, "messages", engine=ACCEPTED),
    # -- n -------------------------------------------------------------------------------------
    Case("n a million", "/v1/completions", completion(n=10**6), {}, 400, "n"),
    Case("n 2**64", "/v1/completions", completion(n=2**64), {}, 400, "n"),
    Case("n -1", "/v1/completions", completion(n=-1), {}, 400, "n"),
    Case("chat n 129", "/v1/chat/completions", chat(n=129), {}, 400, "n"),
    # -- stop ----------------------------------------------------------------------------------
    # OpenAI takes up to 4 stop strings; this server up to 16 (`protocol.MAX_STOP_STRINGS`)
    Case("stop with 5 strings", "/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), {}, *ACCEPTED),
    Case("stop holding a number", "/v1/completions", completion(stop=["a", 5]), {}, 400, "stop"),
    Case("stop nested arrays", "/v1/completions", completion(stop=[["a"]]), {}, 400, "stop"),
    Case("stop an object", "/v1/completions", completion(stop={"a": 1}), {}, 400, "stop"),
    # a long stop string costs the stop check time on every token: at most 256 characters
    Case("stop string of 257 characters", "/v1/completions", completion(stop="x" * 257), {}, 400, "stop"),
    Case(
        "one overlong stop among short ones",
        "/v1/completions",
        completion(stop=["a", "y" * 50_000]),
        {},
        400,
        "stop",
    ),
    Case("stop strings of 256 characters", "/v1/completions", completion(stop=["z" * 256] * 16), {}, *ACCEPTED),
    Case("stop with a lone surrogate", "/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', {}, 400, "stop"),
    # -- unicode -------------------------------------------------------------------------------
    Case("NUL in the prompt", "/v1/completions", completion(prompt="a\u0000b c"), {}, *ACCEPTED),
    Case("escaped surrogate pair (an emoji)", "/v1/completions", b'{"prompt": "hi \\ud83d\\ude00"}', {}, *ACCEPTED),
    Case("zero-width and bidi controls", "/v1/completions", completion(prompt="a\u200b\u202eb\ufeff c"), {}, *ACCEPTED),
    Case("lone low surrogate", "/v1/completions", b'{"prompt": "\\udc00 x"}', {}, 400, "prompt"),
    Case("UTF-8 BOM before the body", "/v1/completions", b'\xef\xbb\xbf{"prompt": "a"}', {}, 400, None),
    Case("overlong UTF-8 encoding", "/v1/completions", b'{"prompt": "\xc0\xaf"}', {}, 400, None),
    Case(
        "lone surrogate in the model name", "/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', {}, 400, "model"
    ),
    Case("lone surrogate in user", "/v1/completions", b'{"prompt": "a", "user": "\\udbff"}', {}, 400, "user"),
    # -- prompt arrays: mixed types, batches (refused: one prompt per request) ----------------------
    Case("prompt array of a string and an id", "/v1/completions", completion(prompt=["a", 1]), {}, 400, "prompt"),
    Case("prompt array of an id and a string", "/v1/completions", completion(prompt=[1, "a"]), {}, 400, "prompt"),
    Case("prompt array of floats", "/v1/completions", completion(prompt=[1.5]), {}, 400, "prompt"),
    Case("prompt array of booleans", "/v1/completions", completion(prompt=[True]), {}, 400, "prompt"),
    Case("prompt array of null", "/v1/completions", completion(prompt=[None]), {}, 400, "prompt"),
    Case("batched token arrays", "/v1/completions", completion(prompt=[[1, 2], [3]]), {}, 400, "prompt"),
    Case("an empty token array in an array", "/v1/completions", completion(prompt=[[]]), {}, 400, "prompt"),
    Case("strings nested in an array", "/v1/completions", completion(prompt=[["a"]]), {}, 400, "prompt"),
    Case("prompt an object", "/v1/completions", completion(prompt={"text": "a"}), {}, 400, "prompt"),
    Case("prompt a boolean", "/v1/completions", completion(prompt=True), {}, 400, "prompt"),
    Case("prompt an empty array", "/v1/completions", completion(prompt=[]), {}, 400, "prompt"),
    Case("token id 2**31", "/v1/completions", completion(prompt=[2**31]), {}, 400, "prompt"),
    Case("token ids beyond the context", "/v1/completions", completion(prompt=[5] * 5000), {}, 400, "prompt"),
    Case("one prompt in an array", "/v1/completions", completion(prompt=["hello there"]), {}, *ACCEPTED),
    Case("one token array in an array", "/v1/completions", completion(prompt=[[5, 6, 7]]), {}, *ACCEPTED),
    # -- max_tokens ----------------------------------------------------------------------------
    Case("max_tokens -1", "/v1/completions", completion(max_tokens=-1), {}, 400, "max_tokens"),
    Case("max_tokens 1e3", "/v1/completions", b'{"prompt": "a", "max_tokens": 1e3}', {}, 400, "max_tokens"),
    Case("max_tokens 1e999", "/v1/completions", b'{"prompt": "a", "max_tokens": 1e999}', {}, 400, "max_tokens"),
    Case(
        "max_tokens of 5000 digits",
        "/v1/completions",
        b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
        {},
        400,
        None,
    ),
    Case("max_tokens null (the default)", "/v1/completions", completion(max_tokens=None), {}, *ACCEPTED),
    # max_completion_tokens wins over max_tokens; each is checked, and an error names the one at fault
    Case(
        "max_completion_tokens and max_tokens",
        "/v1/chat/completions",
        chat(max_completion_tokens=3, max_tokens=2),
        {},
        *ACCEPTED,
    ),
    Case(
        "max_completion_tokens too large beside max_tokens",
        "/v1/chat/completions",
        chat(max_completion_tokens=5000, max_tokens=2),
        {},
        400,
        "max_completion_tokens",
    ),
    Case(
        "max_tokens 0 beside max_completion_tokens",
        "/v1/chat/completions",
        chat(max_completion_tokens=5, max_tokens=0),
        {},
        400,
        "max_tokens",
    ),
    # -- stream_options --------------------------------------------------------------------------
    Case(
        "stream_options with stream false",
        "/v1/completions",
        completion(stream=False, stream_options={"include_usage": True}),
        {},
        400,
        "stream_options",
    ),
    Case(
        "stream_options a list",
        "/v1/completions",
        completion(stream=True, stream_options=["include_usage"]),
        {},
        400,
        "stream_options",
    ),
    Case(
        "continuous_usage_stats text",
        "/v1/completions",
        completion(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "yes"}),
        {},
        400,
        "continuous_usage_stats",
    ),
    # -- response_format -----------------------------------------------------------------------
    Case(
        "json_schema response",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        {},
        400,
        "response_format",
    ),
    Case(
        "response_format a string",
        "/v1/chat/completions",
        chat(response_format="json_object"),
        {},
        400,
        "response_format",
    ),
    Case("response_format empty", "/v1/chat/completions", chat(response_format={}), {}, 400, "response_format"),
    Case(
        "response_format on completions",
        "/v1/completions",
        completion(response_format={"type": "json_object"}),
        {},
        400,
        "response_format",
    ),
    Case("response_format text", "/v1/chat/completions", chat(response_format={"type": "text"}), {}, *ACCEPTED),
    # -- tools and functions: refused when asked for ---------------------------------------------
    Case(
        "chat functions",
        "/v1/chat/completions",
        chat(functions=[{"name": "f", "parameters": {}}]),
        {},
        400,
        "functions",
    ),
    Case("tool_choice required", "/v1/chat/completions", chat(tool_choice="required"), {}, 400, "tool_choice"),
    Case(
        "tool_choice a function",
        "/v1/chat/completions",
        chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        {},
        400,
        "tool_choice",
    ),
    Case("function_call a name", "/v1/chat/completions", chat(function_call={"name": "f"}), {}, 400, "function_call"),
    Case("tools a string", "/v1/chat/completions", chat(tools="all"), {}, 400, "tools"),
    Case("tool_choice none", "/v1/chat/completions", chat(tool_choice="none"), {}, *ACCEPTED),
    Case("tools empty", "/v1/chat/completions", chat(tools=[]), {}, *ACCEPTED),
    Case("suffix", "/v1/completions", completion(suffix="end"), {}, 400, "suffix"),
    Case("audio output", "/v1/chat/completions", chat(modalities=["text", "audio"]), {}, 400, "modalities"),
    Case("web search", "/v1/chat/completions", chat(web_search_options={}), {}, 400, "web_search_options"),
    # -- user, seed, best_of, ignore_eos, priority, model -------------------------------------------
    Case("user a number", "/v1/completions", completion(user=42), {}, 400, "user"),
    Case("user an object", "/v1/chat/completions", chat(user={"id": 1}), {}, 400, "user"),
    Case("seed true", "/v1/completions", completion(seed=True), {}, 400, "seed"),
    Case("seed 1.0", "/v1/completions", b'{"prompt": "a", "seed": 1.0}', {}, 400, "seed"),
    Case("seed 2**64-1", "/v1/completions", completion(seed=2**64 - 1), {}, *ACCEPTED),
    Case("best_of 0", "/v1/completions", completion(best_of=0), {}, 400, "best_of"),
    Case("ignore_eos 1", "/v1/completions", completion(ignore_eos=1), {}, 400, "ignore_eos"),
    Case("priority float", "/v1/completions", completion(priority=1.5), {}, 400, "priority"),
    Case("priority -5", "/v1/completions", completion(priority=-5), {}, *ACCEPTED),
    Case("model empty", "/v1/completions", completion(model=""), {}, 400, "model"),
    Case("model in other case", "/v1/completions", completion(model=MODEL.upper()), {}, 404, "model"),
    Case("model null", "/v1/completions", completion(model=None), {}, *ACCEPTED),
    # -- sampling ranges -----------------------------------------------------------------------
    Case("temperature -0.1", "/v1/completions", completion(temperature=-0.1), {}, 400, "temperature"),
    Case("temperature 2.0000001", "/v1/completions", completion(temperature=2.0000001), {}, 400, "temperature"),
    Case("temperature 1e400", "/v1/completions", b'{"prompt": "a", "temperature": 1e400}', {}, 400, "temperature"),
    Case("top_p 1.5", "/v1/completions", completion(top_p=1.5), {}, 400, "top_p"),
    Case("top_p -0.5", "/v1/completions", completion(top_p=-0.5), {}, 400, "top_p"),
    # issue 15's poison request: values that round to 0 in float32 (greedy below 1e-5; top_p keeps the top token)
    Case("temperature 1e-46", "/v1/completions", completion(temperature=1e-46), {}, *ACCEPTED),
    Case("top_p 1e-46", "/v1/completions", completion(top_p=1e-46, temperature=1.0), {}, *ACCEPTED),
    # -- fields the sim has no model for: refused there (400 naming them), implemented by the engine --
    Case("logprobs 2", "/v1/completions", completion(logprobs=2), {}, 400, "logprobs", engine=ACCEPTED),
    Case(
        "chat logprobs with top_logprobs 2",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=2),
        {},
        400,
        "logprobs",
        engine=ACCEPTED,
    ),
    Case("top_k 5", "/v1/completions", completion(top_k=5), {}, 400, "top_k", engine=ACCEPTED),
    Case("min_p 0.1", "/v1/completions", completion(min_p=0.1), {}, 400, "min_p", engine=ACCEPTED),
    Case(
        "presence_penalty 0.5",
        "/v1/completions",
        completion(presence_penalty=0.5),
        {},
        400,
        "presence_penalty",
        engine=ACCEPTED,
    ),
    Case(
        "chat frequency_penalty 0.5",
        "/v1/chat/completions",
        chat(frequency_penalty=0.5),
        {},
        400,
        "frequency_penalty",
        engine=ACCEPTED,
    ),
    Case(
        "repetition_penalty 1.2",
        "/v1/completions",
        completion(repetition_penalty=1.2),
        {},
        400,
        "repetition_penalty",
        engine=ACCEPTED,
    ),
    Case(
        "logit_bias one entry",
        "/v1/completions",
        completion(logit_bias={"5": 10}),
        {},
        400,
        "logit_bias",
        engine=ACCEPTED,
    ),
    Case(
        "logit_bias with 300 entries",
        "/v1/chat/completions",
        chat(logit_bias=bias(300)),
        {},
        400,
        "logit_bias",
        engine=ACCEPTED,
    ),
    # echo of token ids: the sim's ids are hashes of words and cannot be turned back into text
    Case(
        "echo of token ids",
        "/v1/completions",
        completion(prompt=[5, 6], echo=True, max_tokens=0),
        {},
        400,
        "echo",
        engine=ACCEPTED,
    ),
    Case("echo of a text prompt", "/v1/completions", completion(echo=True), {}, *ACCEPTED),
    Case("logit_bias with 301 entries", "/v1/completions", completion(logit_bias=bias(301)), {}, 400, "logit_bias"),
    Case("logit_bias key with a sign", "/v1/completions", completion(logit_bias={"+5": 1}), {}, 400, "logit_bias"),
    Case(
        "logit_bias key in non-ASCII digits", "/v1/completions", completion(logit_bias={"٣": 1}), {}, 400, "logit_bias"
    ),
    Case("n 2 with a seed", "/v1/completions", completion(n=2, seed=7), {}, *ACCEPTED),
    # -- unknown fields are ignored (as vLLM does); vLLM's extensions that change the output are refused --
    Case("an unknown field", "/v1/completions", completion(frobnicate={"x": [1, 2]}), {}, *ACCEPTED),
    Case("OpenAI's metadata and store", "/v1/chat/completions", chat(metadata={"k": "v"}, store=False), {}, *ACCEPTED),
    Case("vLLM min_tokens", "/v1/completions", completion(min_tokens=4), {}, 400, "min_tokens"),
    Case("vLLM min_tokens 0", "/v1/completions", completion(min_tokens=0), {}, *ACCEPTED),
    Case("vLLM stop_token_ids", "/v1/completions", completion(stop_token_ids=[2]), {}, 400, "stop_token_ids"),
    Case(
        "vLLM include_stop_str_in_output",
        "/v1/completions",
        completion(include_stop_str_in_output=True),
        {},
        400,
        "include_stop_str_in_output",
    ),
    Case("vLLM beam search", "/v1/completions", completion(use_beam_search=True), {}, 400, "use_beam_search"),
    Case("vLLM guided_json", "/v1/chat/completions", chat(guided_json={"type": "object"}), {}, 400, "guided_json"),
    Case("vLLM prompt_logprobs", "/v1/completions", completion(prompt_logprobs=1), {}, 400, "prompt_logprobs"),
    # -- the body and its type ------------------------------------------------------------------
    Case("body null", "/v1/completions", b"null", {}, 400, None),
    Case("body a string", "/v1/completions", b'"hello"', {}, 400, None),
    Case("trailing garbage", "/v1/completions", b'{"prompt": "a"} x', {}, 400, None),
    Case("a comment in the JSON", "/v1/completions", b'{"prompt": "a" /* hi */}', {}, 400, None),
    Case("-Infinity literal", "/v1/completions", b'{"prompt": "a", "top_p": -Infinity}', {}, 400, None),
    Case("no body and no Content-Type", "/v1/completions", None, {"content-type": NO_TYPE}, 415, None),
    Case("raw body without Content-Type", "/v1/completions", b'{"prompt": "a"}', {"content-type": NO_TYPE}, 415, None),
    Case("application/jsonp", "/v1/completions", completion(), {"content-type": "application/jsonp"}, 415, None),
    Case(
        "JSON with a charset",
        "/v1/completions",
        completion(),
        {"content-type": "application/json; charset=utf-8"},
        *ACCEPTED,
    ),
    Case("JSON type in capitals", "/v1/chat/completions", chat(), {"content-type": "APPLICATION/JSON"}, *ACCEPTED),
    # -- the tenant header (checked before the prompt is tokenized: both backends name it) ----------
    Case("tenant header with a semicolon", "/v1/completions", completion(), {"X-Tenant": "t;drop"}, 400, "X-Tenant"),
    Case(
        "bad tenant header and an empty prompt",
        "/v1/completions",
        completion(prompt=""),
        {"X-Tenant": "a b"},
        400,
        "X-Tenant",
    ),
    # -- methods and routes ----------------------------------------------------------------------
    Case("GET on completions", "/v1/completions", None, {}, 405, None, method="GET"),
    Case("GET on chat completions", "/v1/chat/completions", None, {}, 405, None, method="GET"),
    Case("PUT on completions", "/v1/completions", completion(), {}, 405, None, method="PUT"),
    Case("DELETE on chat completions", "/v1/chat/completions", None, {}, 405, None, method="DELETE"),
    Case("POST on models", "/v1/models", {}, {}, 405, None),
    Case("POST on health", "/health", {}, {}, 405, None),
    Case("PATCH on metrics", "/metrics", None, {}, 405, None, method="PATCH"),
    Case("POST on no route", "/v1/nothing", {}, {}, 404, None),
    Case("GET on no route", "/v2/completions", None, {}, 404, None, method="GET"),
    Case("a model that does not exist", f"/v1/models/{MODEL}-2", None, {}, 404, "model", method="GET"),
    Case("a model path with more parts", f"/v1/models/{MODEL}/x", None, {}, 404, "model", method="GET"),
    Case("HEAD on health", "/health", None, {}, *ACCEPTED, method="HEAD"),
]


@pytest.fixture(scope="module", params=BACKENDS)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """One server per backend for the whole module: the sim, then the engine on the demo model
    (served under the sim's model name, so that every case's body fits both)."""
    overrides = {"max_model_len": MAX_MODEL_LEN}
    backend: Backend
    if request.param == "sim":
        backend = sim_backend(overrides=overrides)
    else:
        scheduler_config = SchedulerConfig.from_dict(overrides, base=PRESETS["engine"])
        backend = make_backend("engine", scheduler_config, BackendOptions(served_model_name=MODEL))
    server_config = ServerConfig(max_body_bytes=LIMIT, trust_tenant_header=True)
    running = start_server(server_config=server_config, backend=backend)
    yield running
    running.stop()


def send(server: RunningServer, case: Case) -> httpx.Response:
    headers: dict[str, str] = dict(case.headers)
    kw: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        headers = {"content-type": "application/json", **headers}
        kw["content"] = case.body
    elif case.body is not None:
        kw["json"] = case.body
    if headers.get("content-type") == NO_TYPE:
        del headers["content-type"]
    return server.request(case.method, case.path, headers=headers, **kw)


def backend_of(server: RunningServer) -> str:
    return server.client.model.backend  # "sim" or "engine"


def test_there_are_enough_cases() -> None:
    assert len({c.name for c in CASES}) == len(CASES)  # no case twice
    refused = {b: sum(1 for c in CASES if c.expected(b)[0] >= 400) for b in BACKENDS}
    assert min(refused.values()) >= 150, refused


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_clear_4xx(server: RunningServer, case: Case) -> None:
    status, param = case.expected(backend_of(server))
    r = send(server, case)
    assert r.status_code == status, r.text
    if status < 400:
        if case.method == "HEAD":
            assert not r.content
        elif case.path.startswith("/v1/"):
            body = r.json()
            assert body["choices"] and body["usage"]["prompt_tokens"] >= 1, body
    else:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and len(error["message"]) > 10
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
            assert param.split(".")[-1].split("[")[0] in error["message"] or param in error["message"]
    assert server.get("/health").status_code == 200  # healthy after each


def test_unknown_routes_and_methods_get_json_errors(server: RunningServer) -> None:
    r = server.post("/v1/nothing", json={})
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = server.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_server_stays_healthy_after_bad_input(server: RunningServer) -> None:
    for case in CASES:  # all of them again, then a good request
        send(server, case)
    assert server.get("/health").status_code == 200
    r = server.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle()
    assert not server.scheduler.requests


def test_no_error_was_a_500_and_every_error_was_counted(server: RunningServer) -> None:
    """After the cases (and their replay): /metrics counts the refusals by status, and none is a 5xx."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(server.get("/metrics").text)
        for sample in family.samples
        if sample.name == "contbatch:http_request_errors_total"
    }
    assert not {s: n for s, n in counts.items() if s.startswith("5") and n}, counts
    backend = backend_of(server)
    refused = sum(1 for c in CASES if c.expected(backend)[0] >= 400)
    assert sum(counts.values()) >= refused, counts


def test_a_truncated_upload_does_not_hurt_the_server(server: RunningServer) -> None:
    host, port = server.base_url.removeprefix("http://").split(":")
    import socket

    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": ')
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
