"""The fits on synthetic data: exact recovery of known models, no timing involved."""

from __future__ import annotations

import pytest

from contbatch.calibrate.calibration import _in_loop
from contbatch.calibrate.fit import FitError, StepSample, error_stats, fit_affine, fit_loop, fit_scale, fit_table
from contbatch.calibrate.grid import GridSpec, blocks_needed, decode_contexts, synthetic_step
from contbatch.calibrate.loop import LoopStep
from contbatch.sim.cost import AffineCost


def _sample(prefill: int, decode: int, context_per_decode: int, ms: float) -> StepSample:
    """The shape `synthetic_step` gives a grid point, with a chosen time."""
    start = context_per_decode if decode == 0 else 0
    context = prefill + decode * context_per_decode + (start if prefill else 0)
    requests = decode + (1 if prefill else 0)
    return StepSample(prefill, decode, context, requests, ms)


GRID = GridSpec(prefill=(0, 16, 64, 128), decode=(0, 1, 4, 16), context=(8, 32, 96))


def _grid_samples(price: AffineCost) -> list[StepSample]:
    samples = []
    for p, d, c in GRID.points():
        shape = _sample(p, d, c, 1.0)
        samples.append(_sample(p, d, c, price.step_time(shape.to_output()) * 1000))
    return samples


def test_affine_fit_recovers_the_generating_coefficients() -> None:
    truth = AffineCost(base_ms=4.5, prefill_ms=0.25, decode_ms=0.6, context_ms=0.004)
    fitted = fit_affine(_grid_samples(truth))
    for name in ("base_ms", "prefill_ms", "decode_ms", "context_ms"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-9), name


def test_affine_fit_never_returns_a_negative_coefficient() -> None:
    # time falls with context: least squares would want context_ms < 0; the fit drops it instead
    samples = [_sample(p, d, c, 10.0 + 0.5 * d - 0.01 * c) for p, d, c in GRID.points()]
    fitted = fit_affine(samples)
    assert fitted.context_ms == 0.0
    assert min(fitted.base_ms, fitted.prefill_ms, fitted.decode_ms) >= 0.0


def test_affine_fit_needs_four_samples() -> None:
    with pytest.raises(FitError, match="at least 4"):
        fit_affine([_sample(16, 0, 8, 1.0)] * 3)


def test_table_fit_holds_the_medians_at_grid_points() -> None:
    def price(p: int, d: int, c: int) -> float:
        return 3.0 + 0.1 * p + 0.002 * p * p + 0.7 * d + 0.01 * d * c

    samples = [_sample(p, d, c, price(p, d, c)) for p, d, c in GRID.points()]
    samples += [_sample(16, 4, 32, 1000.0), _sample(16, 4, 32, 1000.0)]  # three at one point: the median wins
    table = fit_table(samples)
    assert table.prefill_axis == GRID.prefill and table.decode_axis == GRID.decode
    assert table.context_axis == GRID.context
    for p, d, c in GRID.points():
        expected = 1000.0 if (p, d, c) == (16, 4, 32) else price(p, d, c)
        assert table.lookup_ms(p, d, c) == pytest.approx(expected, rel=1e-12)
    for c in GRID.context:  # the empty step: below the cheapest real step of its slice, above 0
        empty = table.lookup_ms(0, 0, c)
        assert 0 < empty <= min(price(16, 0, c), price(0, 1, c))


def test_table_fit_refuses_an_incomplete_grid() -> None:
    samples = [_sample(p, d, c, 1.0 + p + d) for p, d, c in GRID.points() if (p, d, c) != (64, 4, 32)]
    with pytest.raises(FitError, match="prefill=64, decode=4, context per decode=32"):
        fit_table(samples)


def test_loop_fit_recovers_base_and_per_request_and_ignores_outliers() -> None:
    counts = [1, 2, 3, 5, 8, 13, 21, 34] * 4
    extra = [0.3 + 0.02 * r for r in counts]
    fit = fit_loop([*counts, 5], [*extra, 250.0])  # and one garbage-collection pause
    assert fit.base_ms == pytest.approx(0.3, rel=1e-9)
    assert fit.request_ms == pytest.approx(0.02, rel=1e-9)
    assert fit.num_used == len(counts)


def test_loop_fit_with_one_request_count_fits_the_base_only() -> None:
    fit = fit_loop([4, 4, 4], [1.0, 2.0, 3.0])
    assert (fit.base_ms, fit.request_ms) == (2.0, 0.0)


def test_loop_fit_needs_matching_samples() -> None:
    with pytest.raises(FitError, match="at least one"):
        fit_loop([1, 2], [1.0])


def test_scale_is_the_ratio_of_total_times() -> None:
    # the slow step (30 ms for 10 predicted) counts with its time: a median ratio would say 1.1
    assert fit_scale([10.0, 10.0, 20.0, 4.0], [11.0, 30.0, 22.0, 4.0]) == pytest.approx(67.0 / 44.0)
    with pytest.raises(FitError):
        fit_scale([0.0], [1.0])


def test_error_stats_are_exact() -> None:
    samples = [StepSample(0, 1, 10, 1, 10.0), StepSample(0, 2, 20, 2, 20.0), StepSample(0, 4, 40, 4, 40.0)]
    stats = error_stats(lambda s: {10.0: 11.0, 20.0: 18.0, 40.0: 40.0}[s.ms], samples)
    assert stats.num_samples == 3
    assert stats.mean_abs == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert stats.bias == pytest.approx(0.0)
    assert stats.total == pytest.approx(69.0 / 70.0 - 1)  # time-weighted: the 20 ms step's -10 % weighs double
    assert stats.max_abs == pytest.approx(0.1) and stats.p90_abs == pytest.approx(0.1)


@pytest.mark.parametrize(("decodes", "mean"), [(1, 40), (2, 40), (7, 100), (64, 384), (3, 1)])
def test_decode_contexts_spread_around_an_exact_mean(decodes: int, mean: int) -> None:
    contexts = decode_contexts(decodes, mean)
    assert len(contexts) == decodes and sum(contexts) == decodes * mean and min(contexts) >= 1
    if decodes > 2 and mean >= 4:
        assert min(contexts) < mean < max(contexts)


def test_synthetic_steps_have_the_grid_coordinates() -> None:
    for point in GRID.points():
        out, seqs = synthetic_step(point, block_size=16, num_blocks=10_000, vocab=50)
        p, d, c = point
        assert (out.num_prefill_tokens, out.num_decode_tokens) == (p, d)
        assert (out.num_context_tokens - p) / max(1, d) == c
        assert sum(len(s.block_table) for s in seqs.values()) == blocks_needed(point, 16)
        assert all(c.samples for c in out.chunks)


def test_in_loop_scales_per_batch_size_bin_from_the_engine_steps() -> None:
    """Runner time in the loop = fit x 1.0 below 8 decodes, x 1.2 for 8-15, x 1.5 for 16+ (only 5
    steps there: too few for a bin of its own), x 0.9 with prefill tokens; loop time 0.5 ms + 0.1
    per request. `_in_loop` recovers each scale exactly and the loop terms; the scale of all
    decode-only steps is their total time over the fit's."""
    fit = AffineCost(base_ms=2.0, prefill_ms=0.1, decode_ms=0.5, context_ms=0.01)
    shapes = [(0, d) for d in range(1, 8) for _ in range(5)] + [(0, d) for d in range(8, 16) for _ in range(3)]
    shapes += [(0, 20)] * 5 + [(64, 4)] * 6

    def step(prefill: int, decodes: int) -> LoopStep:
        out = StepSample(prefill, decodes, prefill + 50 * decodes, decodes + (prefill > 0), 0.0).to_output()
        scale = 0.9 if prefill else 1.0 if decodes < 8 else 1.2 if decodes < 16 else 1.5
        runner = scale * fit.step_time(out) * 1000.0
        return LoopStep(out, runner, runner + 0.5 + 0.1 * out.num_requests)

    profile = _in_loop(fit, [step(*shape) for shape in shapes], [8, 16, 32])
    decodes = [step(*shape) for shape in shapes if not shape[0]]
    total = sum(s.execute_ms for s in decodes) / sum(fit.step_time(s.out) * 1000.0 for s in decodes)
    assert 1.0 < total < 1.5 and profile.loop_scale == pytest.approx(total)
    assert profile.prefill_loop_scale == pytest.approx(0.9)
    assert profile.decode_loop_scales == ((8, pytest.approx(1.2)),)
    assert profile.loop_base_ms == pytest.approx(0.5) and profile.loop_request_ms == pytest.approx(0.1)
    assert _in_loop(fit, [step(*shape) for shape in shapes], []).decode_loop_scales == ()
