"""Retry delays: exponential ceiling with a cap, full jitter, and the policy's validation."""

from __future__ import annotations

import math
import random

import pytest

from jobd.backoff import Backoff, RetryPolicy


def test_ceiling_doubles_from_base_and_stops_at_the_cap() -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    ceilings = [backoff.ceiling(attempt) for attempt in range(1, 13)]
    assert ceilings == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]


def test_ceiling_scales_with_the_base() -> None:
    backoff = Backoff(base=0.5, cap=60.0)
    assert [backoff.ceiling(a) for a in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 32, 60, 60]


def test_attempt_zero_and_below_count_as_the_first() -> None:
    backoff = Backoff(base=2.0, cap=100.0)
    assert backoff.ceiling(0) == backoff.ceiling(-7) == backoff.ceiling(1) == 2.0


def test_ceiling_never_decreases_with_the_attempt() -> None:
    backoff = Backoff(base=0.25, cap=3600.0)
    ceilings = [backoff.ceiling(attempt) for attempt in range(1, 2000)]
    assert ceilings == sorted(ceilings)
    assert ceilings[-1] == 3600.0


@pytest.mark.parametrize("attempt", [64, 65, 1023, 1024, 1025, 10**6, 2**63, 10**100])
def test_huge_attempt_numbers_do_not_overflow(attempt: int) -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    assert backoff.ceiling(attempt) == 300.0
    delay = backoff.delay(attempt, random.Random(attempt % 1000))
    assert math.isfinite(delay)
    assert 0.0 <= delay <= 300.0


def test_delays_stay_within_zero_and_the_ceiling() -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    rng = random.Random(1)
    for attempt in range(1, 40):
        ceiling = backoff.ceiling(attempt)
        for _ in range(200):
            assert 0.0 <= backoff.delay(attempt, rng) <= ceiling


def test_delays_of_a_thousand_draws_are_spread_over_the_window() -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    rng = random.Random(42)
    delays = [backoff.delay(10, rng) for _ in range(1000)]  # window: [0, 300]
    assert len(set(delays)) > 990
    assert min(delays) < 15 and max(delays) > 285
    # Full jitter is uniform: every tenth of the window gets a fair share of the draws.
    buckets = [0] * 10
    for delay in delays:
        buckets[min(int(delay // 30), 9)] += 1
    assert min(buckets) > 50 and max(buckets) < 150
    assert 120 < sum(delays) / len(delays) < 180


def test_a_seeded_rng_makes_delays_reproducible() -> None:
    backoff = Backoff(base=1.0, cap=300.0)
    first, second = random.Random(3), random.Random(3)
    assert [backoff.delay(5, first) for _ in range(20)] == [
        backoff.delay(5, second) for _ in range(20)]


def test_delay_without_an_rng_uses_the_module_generator() -> None:
    backoff = Backoff(base=1.0, cap=8.0)
    delays = {backoff.delay(4) for _ in range(100)}
    assert len(delays) > 90
    assert all(0.0 <= d <= 8.0 for d in delays)


@pytest.mark.parametrize(
    ("base", "cap", "message"),
    [
        (0.0, 300.0, "positive"),
        (-1.0, 300.0, "positive"),
        (1.0, 0.0, "positive"),
        (1.0, -5.0, "positive"),
        (10.0, 5.0, "smaller than its base"),
    ],
)
def test_invalid_base_or_cap_is_refused(base: float, cap: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(base=base, cap=cap)


def test_cap_equal_to_base_is_a_fixed_window() -> None:
    backoff = Backoff(base=5.0, cap=5.0)
    assert {backoff.ceiling(a) for a in range(1, 50)} == {5.0}


@pytest.mark.parametrize(("base", "cap"), [(1.0, math.nan), (math.nan, 300.0)])
def test_nan_base_or_cap_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base=base, cap=cap)


def test_retry_policy_defaults() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts == 8
    assert policy.backoff == Backoff(1.0, 300.0)


@pytest.mark.parametrize("max_attempts", [0, -1, -100])
def test_retry_policy_needs_at_least_one_attempt(max_attempts: int) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(Backoff(), max_attempts)


def test_retry_policy_of_one_attempt_is_valid() -> None:
    assert RetryPolicy(Backoff(0.5, 1.0), 1).max_attempts == 1
