"""What a workload asked for against what the deployment could do with it.

A prefix-cache hit is reused in whole logical blocks of the decode engine (docs/semantics.md §7):
a hit covers at most N-1 of the N prompt tokens, decode loads the rest up to token N-1 (a model
with state) or N (without), and a hit that is not a whole number of its logical blocks is rounded
down. With Kimi-Linear's or Qwen3-Next's large logical blocks (512-1,920 tokens) a small
requested hit can reuse nothing. Each request records both numbers (``prefix_hit_tokens``
requested, ``effective_prefix_hit_tokens`` reused); :func:`hit_rounding_warnings` says so once
per run when they differ.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .geometry.layout import EngineLayout
    from .scenario import Scenario

__all__ = ["hit_rounding_warnings"]

log = logging.getLogger("hkvsim.workload")
_EXAMPLES = 3


def hit_rounding_warnings(scenario: Scenario, records: Sequence[Any],
                          decode: EngineLayout) -> list[str]:
    """One warning (logged, and returned for the JSON ``warnings`` list) when some requests'
    prefix hits were rounded down to whole logical blocks of ``decode``; empty otherwise.

    ``records`` are the run's request records; one whose decode blocks were never allocated
    (``effective_prefix_hit_tokens`` None) is not counted.
    """
    rounded = [r for r in records if r.effective_prefix_hit_tokens is not None
               and r.effective_prefix_hit_tokens < r.prefix_hit_tokens]
    if not rounded:
        return []
    key = "workload.trace" if scenario.workload.trace is not None else "workload.prefix_hit_tokens"
    examples = ", ".join(f"request {r.index} asked {r.prefix_hit_tokens:,} and reused "
                         f"{r.effective_prefix_hit_tokens:,}" for r in rounded[:_EXAMPLES])
    more = f" (and {len(rounded) - _EXAMPLES} more)" if len(rounded) > _EXAMPLES else ""
    message = (f"{scenario.where}: {key}: {len(rounded)} of {len(records)} request(s) asked for "
               f"prefix hits that are not whole logical blocks of decode "
               f"({decode.logical_block_size:,} tokens at TP {decode.tp}) and reuse only the "
               f"whole blocks: {examples}{more}")
    log.warning("%s", message)
    return [message]
