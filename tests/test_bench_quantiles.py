"""The routers benchmark reads the engine's inter-token latency off vLLM's histogram: its quantiles."""

from __future__ import annotations

import math

from bench.routers import histogram_quantile


def _cumulative(values: list[float], bounds: list[float]) -> list[tuple[float, float]]:
    return [(bound, float(sum(1 for value in values if value <= bound))) for bound in [*bounds, math.inf]]


def test_quantiles_of_a_histogram_are_interpolated_within_their_bucket() -> None:
    values = [(i + 0.5) / 1000 for i in range(100)]  # 0.5 ms to 99.5 ms, one in each 1 ms bucket
    buckets = _cumulative(values, [round(0.001 * i, 3) for i in range(1, 151)])
    assert math.isclose(histogram_quantile(buckets, 0.50), 0.050)
    assert math.isclose(histogram_quantile(buckets, 0.99), 0.099)


def test_a_tail_past_the_last_bound_reads_as_that_bound_and_no_observations_as_nan() -> None:
    buckets = _cumulative([0.0005] * 98 + [5.0, 6.0], [0.001, 0.002])
    assert math.isclose(histogram_quantile(buckets, 0.5), 0.001 * 50 / 98)  # spread evenly over its bucket
    assert histogram_quantile(buckets, 0.995) == 0.002
    assert math.isnan(histogram_quantile(_cumulative([], [0.001]), 0.99))
