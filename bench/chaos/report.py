"""The chaos benchmark's figures: one load's outcomes classified into a ``FaultResult`` row,
and the rows as a markdown table.

``summarize`` counts each request (a ``bench.loadgen.client.RequestOutput``) once: errored
(an HTTP error, an ``error`` event, a broken connection or no text at all), else lost (cut
without ``[DONE]``), else mismatched (finished with a text other than the fault-free run's);
TTFT p99 is taken over requests started in the ``DURING_WINDOW_S`` after the fault and over
those started after recovery. Times are seconds since the load began.

How it fails: it never raises on odd outcomes; a figure with no requests behind it is
``None`` (``-`` in the table), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.common import percentile
from bench.loadgen.client import RequestOutput

DURING_WINDOW_S = 20.0


@dataclass
class FaultResult:
    fault: str
    requests: int = 0
    in_flight_at_fault: int = 0
    """Requests of the load started before the fault and still streaming when it hit."""
    lost: int = 0
    errored: int = 0
    mismatched: int = 0
    ttft_p99_during_s: float | None = None
    ttft_p99_after_s: float | None = None
    recovery_s: float | None = None
    leaked_blocks: int | None = None
    note: str = ""
    errors: list[str] = field(default_factory=list)


def p99(values: list[float]) -> float | None:
    """The p99 rounded to the millisecond; None for no values (no request behind it)."""
    return round(percentile(values, 99), 3) if values else None


def summarize(
    name: str,
    outcomes: list[RequestOutput],
    baseline: dict[int, str],
    fault_at_s: float | None,
    recovered_at_s: float | None,
) -> FaultResult:
    """One load's row; ``baseline`` maps a prompt's index (``conversation_id``) to its
    fault-free text."""
    res = FaultResult(fault=name, requests=len(outcomes))
    during, after = [], []
    for o in outcomes:
        expected = baseline.get(o.conversation_id)
        if o.error:
            res.errored += 1
            if len(res.errors) < 5:
                res.errors.append(o.error)
        elif not o.done:
            res.lost += 1
        elif expected is not None and expected != o.generated_text:
            res.mismatched += 1
        if fault_at_s is None:
            continue
        if o.start_s < fault_at_s < o.start_s + o.latency_s:
            res.in_flight_at_fault += 1
        if not o.token_times_s:
            continue
        if fault_at_s <= o.start_s < fault_at_s + DURING_WINDOW_S:
            during.append(o.ttft_s)
        elif recovered_at_s is not None and o.start_s >= recovered_at_s:
            after.append(o.ttft_s)
    res.ttft_p99_during_s, res.ttft_p99_after_s = p99(during), p99(after)
    return res


def markdown(header: dict, rows: list[dict]) -> str:
    cols = [
        "fault",
        "requests",
        "in_flight_at_fault",
        "lost",
        "errored",
        "mismatched",
        "ttft_p99_during_s",
        "ttft_p99_after_s",
        "recovery_s",
        "leaked_blocks",
        "note",
    ]
    lines = [
        f"Chaos run {header['date']} ({header['cpu']}, {header['cpus']} CPUs): {header['load']}.",
        f"Command: `{header['command']}`",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append(
            "| " + " | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols) + " |"
        )
    return "\n".join(lines) + "\n"
