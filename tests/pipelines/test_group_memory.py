"""The memory benchmark's trace (benchmarks/bench_groups.py, `--quick`: 24 requests of 8k
tokens): under one budget, mokv's cache groups run all 24 at once, as MAX 26.7's Jenga
manager does, at least twice as many as the same cache without groups, with no
preemption, and every manager finds the shared prefixes, mokv's groups at least as
many as MAX's."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_groups  # noqa: E402


def test_groups_hold_a_window_not_a_length() -> None:
    result = bench_groups.run(quick=True)["managers"]
    groups, plain, jenga = (result[k] for k in ("mokv, groups", "mokv, no groups", "MAX 26.7, Jenga"))
    assert "error" not in groups and "error" not in plain and "error" not in jenga, result
    assert groups["peak_running"] >= 2 * plain["peak_running"], result
    assert groups["peak_running"] == jenga["peak_running"] == 24, result  # the whole quick trace
    assert groups["preemptions"] == plain["preemptions"] == jenga["preemptions"] == 0, result
    assert min(s["hit_rate"] for s in (groups, plain, jenga)) > 0.25, result
    assert groups["hit_rate"] >= jenga["hit_rate"], result  # one budget, windows kept
    assert 0.9 < groups["peak_used_share"] <= 1, result
