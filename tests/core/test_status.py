"""The request state machine: every allowed edge works, every other one raises."""

from __future__ import annotations

import itertools

import pytest

from contbatch.core.request import Request
from contbatch.core.status import FinishReason, IllegalTransition, RequestStatus, check_transition

W, R, P, F = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.FINISHED
ALLOWED = {(W, R), (W, F), (R, P), (R, F), (P, R), (P, F)}
ALL_PAIRS = list(itertools.product(RequestStatus, RequestStatus))
FORBIDDEN = [pair for pair in ALL_PAIRS if pair not in ALLOWED]


def test_the_edge_lists_cover_every_pair() -> None:
    assert len(ALLOWED) + len(FORBIDDEN) == 16
    assert (F, F) in FORBIDDEN and (W, W) in FORBIDDEN and (W, P) in FORBIDDEN


@pytest.mark.parametrize(("old", "new"), sorted(ALLOWED, key=str))
def test_allowed_edges(old: RequestStatus, new: RequestStatus) -> None:
    check_transition("r", old, new)


@pytest.mark.parametrize(("old", "new"), sorted(FORBIDDEN, key=str))
def test_forbidden_edges_raise(old: RequestStatus, new: RequestStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"'r'.*{old.value} -> {new.value}"):
        check_transition("r", old, new)


@pytest.mark.parametrize(("old", "new"), ALL_PAIRS, ids=str)
def test_request_move_to_follows_the_machine(old: RequestStatus, new: RequestStatus) -> None:
    request = Request("r", 0.0, 4, 2)
    request.status = old  # put it in `old` directly: reaching every state is not what is tested
    if (old, new) in ALLOWED:
        request.move_to(new)
        assert request.status is new
    else:
        with pytest.raises(IllegalTransition):
            request.move_to(new)
        assert request.status is old  # a refused move changes nothing


def test_is_waiting() -> None:
    assert W.is_waiting and P.is_waiting
    assert not R.is_waiting and not F.is_waiting


def test_full_lifecycle_through_request_methods() -> None:
    request = Request("r", 1.0, 4, 2)
    assert request.status is W
    request.admit(2.0)
    request.num_computed_tokens = 3
    request.append_output((7,), 3.0)
    request.preempt(4.0)
    assert request.status is P
    assert request.num_computed_tokens == 0 and request.num_preemptions == 1
    assert request.num_output_tokens == 1  # a recompute preemption keeps the sampled outputs
    request.admit(5.0)
    request.finish(FinishReason.LENGTH, 6.0)
    assert request.is_finished and request.finish_reason is FinishReason.LENGTH
    assert request.timeline.scheduled_ts == [2.0, 5.0]
    assert request.timeline.preempted_ts == [4.0]
    assert request.timeline.finish_reason is FinishReason.LENGTH


def test_append_token_is_append_output_of_one_token() -> None:
    one, many = Request("a", 1.0, 4, 3), Request("b", 1.0, 4, 3)
    for ts, token_id in ((2.0, 5), (2.0, 6), (3.5, 7)):
        one.append_token(token_id, ts)
        many.append_output((token_id,), ts)
    assert one.output_token_ids == many.output_token_ids == [5, 6, 7]
    assert one.num_output_tokens == many.num_output_tokens == 3
    assert one.timeline.token_ts == many.timeline.token_ts == [2.0, 2.0, 3.5]
    assert one.timeline.token_counts == many.timeline.token_counts == [1, 1, 1]


def test_finish_is_terminal() -> None:
    request = Request("r", 0.0, 4, 2)
    request.finish(FinishReason.CANCELLED, 1.0)
    with pytest.raises(IllegalTransition):
        request.finish(FinishReason.LENGTH, 2.0)
    with pytest.raises(IllegalTransition):
        request.admit(2.0)
    assert request.finish_reason is FinishReason.CANCELLED
    assert request.timeline.finish_reason is FinishReason.CANCELLED


def test_waiting_cannot_be_preempted() -> None:
    request = Request("r", 0.0, 4, 2)
    with pytest.raises(IllegalTransition):
        request.preempt(1.0)
    assert request.num_preemptions == 0


@pytest.mark.parametrize(("prompt", "output"), [(0, 1), (1, 0), (-1, 3)])
def test_request_rejects_empty_lengths(prompt: int, output: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        Request("r", 0.0, prompt, output)
