"""Task timings: wall time per call and cache hits, as the quantize stage records them."""

import pytest
from prefect import flow, task
from prefect.cache_policies import INPUTS

from flows.timings import TaskClock, plain_call, timings_markdown

CALLS = []


@task(cache_policy=INPUTS, persist_result=True)
def _square(x: int, salt: str) -> int:
    CALLS.append(x)
    return x * x


@task
def _fails(x: int) -> int:
    raise ValueError(f"bad input {x}")


def test_task_clock_records_computed_then_cached_calls(prefect_harness, tmp_path):
    salt = str(tmp_path)  # a fresh cache key per test run
    clock = TaskClock()

    @flow
    def twice() -> list[int]:
        return [clock("square 3", _square, 3, salt), clock("square 3 again", _square, 3, salt),
                plain_call("square 4", _square, 4, salt)]

    assert twice() == [9, 9, 16]
    assert CALLS.count(3) == 1  # the second call was answered by the cache
    assert [(r["task"], r["cached"]) for r in clock.records] == [("square 3", False), ("square 3 again", True)]
    assert all(r["seconds"] >= 0 for r in clock.records)


def test_task_clock_raises_the_task_error_and_records_it(prefect_harness):
    clock = TaskClock()

    @flow
    def once() -> int:
        return clock("fails", _fails, 2)

    with pytest.raises(ValueError, match="bad input 2"):
        once()
    assert [(r["task"], r["cached"]) for r in clock.records] == [("fails", False)]


def test_timings_markdown_totals_and_rows_slowest_first():
    md = timings_markdown([{"task": "a", "seconds": 1.0, "cached": True},
                           {"task": "b", "seconds": 3.0, "cached": False}])
    assert "2 task calls, 4.0 s in all: 1 computed (3.0 s), 1 answered by the cache (1.0 s)" in md
    rows = [line for line in md.splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert rows == ["| b | 3.0 | 75.0 % | no |", "| a | 1.0 | 25.0 % | yes |"]
