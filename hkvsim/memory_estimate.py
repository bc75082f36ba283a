"""How much memory a run will need, before running it (issue #14).

A verified run keeps real bytes: each rank's cache is a lazily committed buffer (pages are
committed when first written), and the block pool hands blocks out first-in first-out, so over a
run an engine touches ``min(its logical blocks, the blocks its requests allocate)`` blocks, each
``num_tensors * unified_page_bytes`` per rank. A timing-only run moves no bytes and commits no
cache page. Both prepare descriptor lists (each rank's local list; the initiator's ranks also a
split list and the list of each remote rank they pair with), kept by the simulated transport as
affine descriptions (a few numbers per cache region: they do not grow with num_blocks; the
real NIXL backend materialises them, 24 B per descriptor, in its rank processes), keep the
block pools' bookkeeping (20 B per logical block per engine) and one record per request, on top
of the interpreter, which ``BASE_BYTES`` approximates (Python, numpy, simpy and hkvsim imported).
An estimate, not a bound: measured peaks of timing-only Kimi-Linear-48B runs were within 8 % of it
either way (67 vs 72 MiB at 200 requests, 1,432 vs 1,416 MiB at 100,000); what it is for is the
large runs, whose cache pages dominate and are counted exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryEstimate", "MemoryGuardError", "estimate_memory", "available_memory", "check_fits",
           "describe", "BASE_BYTES"]

BASE_BYTES = 64 * 2**20  # interpreter + imports, measured on CPython 3.11 (50-55 MiB)
# one request's record, times, telemetry and transport bookkeeping: a 100,000-request
# timing-only Kimi-Linear run (2x P TP4 -> 2x D TP8) peaks at 1,416 MiB, 13.8 KiB per request
RECORD_BYTES = 14 * 2**10
POOL_BYTES = 20  # per logical block per engine: free-queue slot (4 B), owner and version (16 B)
SEGMENT_BYTES = 7 * 8  # one segment of an affine list (seven int64 fields)
LIST_BYTES = 4 * 2**10  # one prepared list's fixed cost (arrays, ledger entry, handle)
_ORACLE_BYTES = (1 << 16) * 8 * 4  # the oracle's reusable batches per engine


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory, in bytes, of a verified and of a timing-only run of one scenario."""

    cache_pages: int  # cache pages a verified run commits (every rank)
    oracle: int  # the oracle's buffers (verified only)
    descriptor_lists: int  # prepared descriptor lists (both kinds of run)
    records: int  # per-request records (both kinds of run)
    pools: int = 0  # block pools' bookkeeping (both kinds of run)
    base: int = BASE_BYTES

    @property
    def timing_only(self) -> int:
        return self.base + self.descriptor_lists + self.records + self.pools

    @property
    def verified(self) -> int:
        return self.timing_only + self.cache_pages + self.oracle

    def as_dict(self) -> dict[str, int]:
        return {"verified_bytes": self.verified, "timing_only_bytes": self.timing_only,
                "cache_pages_bytes": self.cache_pages, "oracle_bytes": self.oracle,
                "descriptor_list_bytes": self.descriptor_lists, "records_bytes": self.records,
                "pool_bytes": self.pools}


def _list_bytes(layout: Any) -> int:
    """One prepared list: one segment per attention region, then one per state region and
    sub-region (independent of num_blocks)."""
    segments = len(layout.regions)
    state = layout.model.state
    if layout.is_hybrid and state is not None:
        segments += len(layout.state_regions) * len(state.subregion_names)
    return LIST_BYTES + segments * SEGMENT_BYTES


def _request_blocks(layout: Any, tokens: int) -> int:
    attention = len(layout.attention_groups) or 1
    return layout.blocks_for_tokens(max(tokens, 0)) * attention + len(layout.state_groups)


def estimate_memory(dep: Any) -> MemoryEstimate:
    """The estimate for a built deployment (hkvsim.pd.deployment.Deployment)."""
    prompts = [int(p) for p in dep.prompts]
    cache = oracle = descs = pools = 0
    for role, engines in dep.engines.items():
        if not engines:
            continue
        layout = engines[0].layout
        tokens = [dep.prefill_tokens(p) if role == "prefill" else p for p in prompts]
        wanted = sum(_request_blocks(layout, t) for t in tokens)
        touched = min(len(engines) * layout.num_logical_blocks, wanted)
        pools += POOL_BYTES * layout.num_logical_blocks * len(engines)
        per_block = layout.num_tensors * layout.unified_page_bytes
        cache += touched * per_block * layout.tp
        oracle += _ORACLE_BYTES * len(engines)
    # the initiator (decode when pulling, prefill when pushing) prepares its local list, one
    # split list per source it pairs with and that source's list; the other side its local list
    push = dep.scenario.connector.mode == "push"
    initiators = dep.engines.get("prefill" if push else "decode", [])
    targets = dep.engines.get("decode" if push else "prefill", [])
    for spec in targets:
        descs += _list_bytes(spec.layout) * spec.layout.tp
    for spec in initiators:
        layout = spec.layout
        other = targets[0].layout if targets else layout
        peers = max(1, math.ceil(other.tp / layout.tp))
        sub = max(1, other.kernel_block_size // layout.kernel_block_size)
        lists = _list_bytes(layout) * (1 + peers * sub) + peers * _list_bytes(other)
        descs += lists * layout.tp
    return MemoryEstimate(cache_pages=cache, oracle=oracle, descriptor_lists=descs,
                          records=RECORD_BYTES * len(prompts), pools=pools)


def available_memory() -> int | None:
    """Memory the system can give a new run now (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def describe(n: int) -> str:
    """Bytes as a short human figure (MiB below 1 GiB, else GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class MemoryGuardError(ValueError):
    """A verified run that will not fit in the memory available (run it timing-only, with
    fewer requests or blocks, or force it)."""


def check_fits(scenario: Any, *, timing_only: bool, available: int | None = None) -> None:
    """Refuse (MemoryGuardError, one line) a verified run whose estimate exceeds the memory
    available now; timing-only runs and unknown availability pass."""
    from .pd.deployment import build_deployment

    if timing_only or not scenario.workload.verify:
        return
    free = available_memory() if available is None else available
    if free is None:
        return
    est = estimate_memory(build_deployment(scenario))
    if est.verified > free:
        raise MemoryGuardError(
            f"scenario {scenario.scenario.name!r}: a verified run needs about "
            f"{describe(est.verified)} ({describe(est.cache_pages)} of cache pages touched) but "
            f"{describe(free)} is available; run it with --timing-only (about "
            f"{describe(est.timing_only)}), with fewer requests or blocks, or add --force")
