"""Wall time of every task call of a flow, and whether Prefect's cache answered it.

``clock = TaskClock()``; ``clock("posterior lite0-fmnist s17", posterior_task, *args)`` runs the
task like a plain call (its result, or its exception) and records the call's wall seconds and
whether the state was ``Cached``, and says so (console and the Prefect run's log). :func:`timings_markdown` renders the records for
``reports/timings.md``.
"""

from __future__ import annotations

import time
from typing import Any

from flows.tracking import say


class TaskClock:
    """Records ``{"task", "seconds", "cached"}`` per call, in call order."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def __call__(self, label: str, task, *args, **kwargs) -> Any:
        start = time.perf_counter()
        state = task(*args, return_state=True, **kwargs)
        record = {"task": label, "seconds": round(time.perf_counter() - start, 3), "cached": state.name == "Cached"}
        self.records.append(record)
        say(f"[task] {label}: {record['seconds']:.1f} s, {'cache hit' if record['cached'] else 'computed'}")
        return state.result()


def plain_call(label: str, task, *args, **kwargs) -> Any:
    """:class:`TaskClock`'s signature without recording (callers that keep no clock)."""
    return task(*args, **kwargs)


def timings_markdown(records: list[dict], title: str = "Quantize stage: wall time per task") -> str:
    """Markdown: totals (computed vs cache hits), then one row per task call, slowest first."""
    computed = [r for r in records if not r["cached"]]
    hits = [r for r in records if r["cached"]]
    total = sum(r["seconds"] for r in records)
    lines = [f"# {title}", "",
             f"{len(records)} task calls, {total:.1f} s in all: {len(computed)} computed "
             f"({sum(r['seconds'] for r in computed):.1f} s), {len(hits)} answered by the cache "
             f"({sum(r['seconds'] for r in hits):.1f} s). Wall seconds of each call as the flow saw it "
             "(a cache hit still loads its result). Written by `flows/quantize.py` from "
             "`results/timings.json`.", "",
             "| task | wall s | share | cache hit |", "|---|---|---|---|"]
    for r in sorted(records, key=lambda r: -r["seconds"]):
        share = 100 * r["seconds"] / total if total else 0.0
        lines.append(f"| {r['task']} | {r['seconds']:.1f} | {share:.1f} % | {'yes' if r['cached'] else 'no'} |")
    return "\n".join(lines) + "\n"
