"""The gateway's pure parts: backends and config, what a router is told about a request, load
scrapes from Prometheus text, SSE event splitting and token counting."""

from __future__ import annotations

import pytest

from contbatch.gateway.balancer import Balancer
from contbatch.gateway.config import GatewayConfig, GatewayConfigError, parse_backend
from contbatch.gateway.estimate import prompt_of, route_request
from contbatch.gateway.proxy import _Events, _TokenCount, event_data
from contbatch.gateway.scrape import parse_scrape
from contbatch.routing import RouteRequest, Scrape, text_block_keys, token_block_keys


def test_backends() -> None:
    assert parse_backend("http://10.0.0.1:8000/v1/") == parse_backend("10.0.0.1:8000=http://10.0.0.1:8000")
    assert parse_backend("gpu-3=https://host.example/prefix").url == "https://host.example/prefix"
    assert parse_backend("https://host.example").name == "host.example"
    for bad in ("10.0.0.1:8000", "http://", "http://h:99999", "http://h:1/?a=b", "http://u:p@h:1", "a b=http://h:1"):
        with pytest.raises(GatewayConfigError):
            parse_backend(bad)
    with pytest.raises(GatewayConfigError, match="at least one backend"):
        GatewayConfig(()).check()
    with pytest.raises(GatewayConfigError, match="chars_per_token"):
        GatewayConfig((parse_backend("http://h:1"),), chars_per_token=0).check()


def test_what_a_router_is_told() -> None:
    text = "the of and to " * 40  # 560 characters
    route = route_request({"prompt": text, "max_tokens": 7}, "r1", chat=False, tenant="t")
    assert route == RouteRequest("r1", 140, 7, (), "t")
    keyed = route_request({"prompt": text}, "r2", chat=False, prefix_block_chars=64)
    assert keyed.max_output_tokens == 16  # OpenAI's completion default
    assert keyed.prefix_keys == text_block_keys(text, 64, 256) and len(keyed.prefix_keys) == 8
    ids = list(range(40))
    by_ids = route_request({"prompt": ids, "n": 2, "max_tokens": 5}, "r3", chat=False, prefix_block_chars=64)
    assert (by_ids.num_prompt_tokens, by_ids.max_output_tokens) == (40, 10)
    assert by_ids.prefix_keys == token_block_keys(ids, 16, 256)
    parts = [{"type": "text", "text": "efgh"}, {"type": "image_url"}]
    messages = [{"role": "system", "content": "abcd"}, {"role": "user", "content": parts}]
    chat = {"messages": messages, "max_completion_tokens": 9, "max_tokens": 3}
    assert prompt_of(chat, chat=True) == ("abcd\nefgh", None)
    assert route_request(chat, "r4", chat=True).max_output_tokens == 9
    assert route_request({"messages": []}, "r5", chat=True, default_max_tokens=77).max_output_tokens == 77
    assert prompt_of({"prompt": ["ab", "cd"]}, chat=False) == ("ab\ncd", None)
    assert prompt_of({"prompt": [[1, 2], [3]]}, chat=False) == ("", [1, 2, 3])
    odd = route_request({"prompt": 5, "max_tokens": "many", "n": True}, "r6", chat=False)  # the backend's 400
    assert (odd.num_prompt_tokens, odd.max_output_tokens) == (0, 16)


CONTBATCH = """# HELP contbatch:num_requests_running Requests in the running set.
# TYPE contbatch:num_requests_running gauge
contbatch:num_requests_running{model_name="m"} 3.0
# TYPE contbatch:num_requests_waiting gauge
contbatch:num_requests_waiting{model_name="m"} 5.0
# TYPE contbatch:kv_cache_usage_perc gauge
contbatch:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE contbatch:generation_tokens counter
contbatch:generation_tokens_total{model_name="m"} 100.0
"""


def test_scrapes() -> None:
    assert parse_scrape(CONTBATCH, 7.0) == Scrape(7.0, 5, 3, 0.25)
    two_models = (
        'vllm:num_requests_waiting{model_name="a"} 1\nvllm:num_requests_waiting{model_name="b"} 2\n'
        'vllm:num_requests_running{model_name="a"} 4\nvllm:gpu_cache_usage_perc{model_name="a"} 0.5\n'
        'vllm:gpu_cache_usage_perc{model_name="b"} 0.75\n'
    )
    assert parse_scrape(two_models, 1.0) == Scrape(1.0, 3, 4, 0.75)
    assert parse_scrape("sglang:num_queue_reqs 2\nsglang:num_running_reqs 1\nsglang:token_usage 0.1\n", 0.0) == Scrape(
        0.0, 2, 1, 0.1
    )
    assert parse_scrape("process_cpu_seconds_total 3\n", 0.0) is None  # no load gauges: own counts
    assert parse_scrape("this is { not prometheus", 0.0) is None
    assert parse_scrape("vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 7\n", 0.0) == Scrape(0.0, 0, 2, 1.0)


def test_sse_events_are_split_whole() -> None:
    events = _Events()
    assert events.feed(b'data: {"a"') == []
    assert events.feed(b": 1}\r") == []
    assert events.feed(b"\n\r\ndata: [DONE]\n") == [b'data: {"a": 1}']
    assert events.feed(b"\n: comment\n\nevent: x\ndata: 1\ndata: 2\n\n") == [b"data: [DONE]", b": comment",
                                                                             b"event: x\ndata: 1\ndata: 2"]  # fmt: skip
    assert event_data(b"event: x\ndata: 1\ndata:2") == "1\n2"
    assert event_data(b": comment") is None


def test_token_counting_feeds_the_tracker() -> None:
    balancer = Balancer("least_work", ["a"])
    balancer.route(RouteRequest("r", 100, 10))
    count = _TokenCount(balancer, "r")
    view = balancer.tracker.view("a")
    count.on_data('{"choices": [{"index": 0, "text": ""}]}')  # no output yet
    assert (view.pending_prompt_tokens, view.num_decoding) == (100, 0)
    count.on_data('{"choices": [{"index": 0, "text": " x"}], "usage": {"completion_tokens": 3}}')
    assert (view.pending_prompt_tokens, view.num_decoding, view.decode_tokens) == (0, 1, 7)  # 9 - 2 more
    count.on_data('{"choices": [{"index": 0, "delta": {"content": " y"}}]}')  # no usage: one token
    assert view.decode_tokens == 6
    count.on_data('{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}')
    count.on_data('{"error": {"message": "x"}}')
    count.on_data("not json")
    assert view.decode_tokens == 6
    balancer.finished("r")
    balancer.tracker.check()
    assert view.num_in_flight == view.decode_tokens == 0
