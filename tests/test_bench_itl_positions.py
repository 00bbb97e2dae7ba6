"""bench.itl_positions splits each stream's inter-token gaps by where they fall in it."""

from __future__ import annotations

from bench.itl_positions import regions


def test_a_streams_gaps_split_into_its_first_ten_its_last_ten_and_the_rest() -> None:
    long = [float(i) for i in range(25)]
    short = [100.0 + i for i in range(12)]  # shorter than both ends: its first ten come first
    split = regions([long, short])
    assert split["first ten"] == long[:10] + short[:10]
    assert split["middle"] == long[10:15]
    assert split["last ten"] == long[15:] + short[10:]
