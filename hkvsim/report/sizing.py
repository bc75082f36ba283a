"""P/D sizing: the transfer's share of time-to-first-token at a given prefill throughput.

``[prefill] tokens_per_second`` (prompt tokens per second per prefill rank) turns a request's
prompt into prefill compute time = computed tokens / (tokens_per_second x prefill TP), where the
computed tokens are the prompt less its prefix-cache hit. TTFT is taken as prefill compute + the
request's own transfer time (:func:`hkvsim.results.transfer_span`), the part of TTFT that P/D
disaggregation adds; queueing and decode's first step are left out. Where the transfer exceeds
the prefill compute, the transfer, not prefill, limits TTFT.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KNOB", "sizing_rows"]

KNOB = "prefill.tokens_per_second"


def sizing_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request rows (``data.request_rows``) of variants that set the knob, with
    ``prefill_seconds``, ``ttft_seconds`` and ``transfer_share`` (transfer / TTFT) added."""
    out = []
    for r in rows:
        rate = r["variant"].settings.get(KNOB)
        if not rate or not r["prefill_tp"]:
            continue
        prefill = (r["prompt_tokens"] - r["hit_tokens"]) / (float(rate) * r["prefill_tp"])
        ttft = prefill + r["transfer"]
        out.append({**r, "tokens_per_second": float(rate), "prefill_seconds": prefill,
                    "ttft_seconds": ttft,
                    "transfer_share": r["transfer"] / ttft if ttft > 0 else 0.0})
    return out
