"""``hkvsim diff FILE``: run a scenario with hkvsim's connector core and with vLLM's, and say
where they differ.

Both runs use the same deployment, coordinator, simulated fabric, workload and oracle; only the
connector code differs. Compared, per variant: the handshake verdict (the errors each reported);
per request: its status and failure class, the transfers it took (one READ per source rank in
pull) and the ranks they ran between (the fabric path of each), its descriptor count and bytes
in all and per rank pair, and the oracle's verdict on its bytes, in all and per rank and cache
region (from the mismatches it reported).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..pd.records import RunResult
from ..scenario import Scenario

__all__ = ["Difference", "compare_results", "with_implementation", "core_extent",
           "diff_scenario"]

FIELDS = ("status", "failure_class", "transfers", "sources", "descriptors", "nbytes",
          "per_rank", "byte_exact", "wrong_regions")
# the start of the oracle's mismatch line: "<engine> rank <r>, layer <l> (<kind>)"
_REGION = re.compile(r"^(\S+ rank \d+), layer (\d+) \(([^)]*)\)")


@dataclass(frozen=True)
class Difference:
    variant: str
    request: int | None  # None: a run-level difference (handshake verdict, outcome)
    field: str
    hkvsim: Any
    vllm: Any

    def as_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "request": self.request, "field": self.field,
                "hkvsim": self.hkvsim, "vllm": self.vllm}

    def __str__(self) -> str:
        where = "run" if self.request is None else f"request {self.request}"
        return f"{self.variant}: {where}: {self.field}: hkvsim {self.hkvsim!r}, vllm {self.vllm!r}"


def with_implementation(scenario: Scenario, implementation: str, *,
                        like_vllm: str | None = None) -> Scenario:
    """``scenario`` run by ``implementation``. ``like_vllm`` (a vLLM version; None: as the
    file says): hkvsim's core moves what that release moves (its ``transfer_extent``,
    ``core_extent``), unless the file sets ``connector.transfer_extent`` itself."""
    update: dict[str, Any] = {"implementation": implementation}
    if implementation == "hkvsim" and like_vllm is not None:
        update["transfer_extent"] = core_extent(scenario, like_vllm)
    connector = scenario.connector.model_copy(update=update)
    return scenario.model_copy(update={"connector": connector})


def core_extent(scenario: Scenario, vllm_version: str | None) -> str:
    """The transfer extent hkvsim's core runs with beside vLLM ``vllm_version``: the file's
    ``connector.transfer_extent`` where it sets one, else the release's (0.34.0 moves only
    what the request needs: docs/vllm.md), else the default."""
    if "transfer_extent" in scenario.connector.model_fields_set or vllm_version is None:
        return scenario.connector.transfer_extent
    from .vllm.engine import release_transfer_extent

    return release_transfer_extent(vllm_version)


def _sources(telemetry: list[dict[str, Any]]) -> list[str]:
    """Where each transfer's bytes came from and went to, as the fabric routed them (the first
    and last link of its path: the source rank's and the destination rank's ports)."""
    out = []
    for t in telemetry:
        path = t.get("path") or ()
        out.append(f"{path[0]} -> {path[-1]}" if path else "?")
    return sorted(out)


def _per_rank(telemetry: list[dict[str, Any]]) -> list[str]:
    """Each transfer's rank pair (first and last port of its path) with its descriptors and
    bytes: where a request's total agrees but its split over the ranks does not."""
    out = []
    for t in telemetry:
        path = t.get("path") or ()
        pair = f"{path[0]} -> {path[-1]}" if path else "?"
        out.append(f"{pair}: {t.get('descriptors')} descriptors, {t.get('nbytes')} B")
    return sorted(out)


def _wrong_regions(mismatches: list[str]) -> list[str]:
    """The rank and cache region (layer and kind: K/V, MLA, conv, recurrent, untransferred
    tail) of every mismatch the oracle reported for a request (its first 8)."""
    found = (_REGION.match(m) for m in mismatches)
    return sorted({f"{m.group(1)}, layer {m.group(2)} ({m.group(3)})" for m in found if m})


def _request_view(result: RunResult) -> list[dict[str, Any]]:
    return [{"status": r.status, "failure_class": r.failure_class, "transfers": r.transfers,
             "sources": _sources(r.telemetry),
             "descriptors": r.descriptors, "nbytes": r.nbytes,
             "per_rank": _per_rank(r.telemetry), "wrong_regions": _wrong_regions(r.mismatches),
             "byte_exact": (r.status == "ok" and r.mismatched_words == 0) if result.verified
             else None} for r in result.records]


def compare_results(variant: str, core: RunResult, vllm: RunResult) -> list[Difference]:
    out: list[Difference] = []
    verdict = (lambda r: "ok" if not r.handshake_errors else "refused")
    if verdict(core) != verdict(vllm):
        out.append(Difference(variant, None, "handshake", verdict(core), verdict(vllm)))
    if core.outcome != vllm.outcome:
        out.append(Difference(variant, None, "outcome", core.outcome, vllm.outcome))
    a, b = _request_view(core), _request_view(vllm)
    for i, (ra, rb) in enumerate(zip(a, b)):
        out.extend(Difference(variant, i, f, ra[f], rb[f]) for f in FIELDS if ra[f] != rb[f])
    if len(a) != len(b):
        out.append(Difference(variant, None, "requests", len(a), len(b)))
    return out


def diff_scenario(scenario: Scenario, backend: str = "sim"
                  ) -> tuple[list[Difference], RunResult, RunResult]:
    """Both implementations on ``backend``: the simulated fabric, or real NIXL agents (one
    process per rank; the transfers' fabric paths are then unknown to both, so "sources"
    compares equal, and everything else is compared as on the fabric). hkvsim's core moves
    what the installed vLLM release moves (``with_implementation``, ``like_vllm``)."""
    from .vllm.engine import vllm_version

    pair = [with_implementation(scenario, "hkvsim", like_vllm=vllm_version()),
            with_implementation(scenario, "vllm")]
    if backend == "nixl":
        from ..drivers.nixl import run_for_cli

        core, vllm = run_for_cli(pair)
    elif backend == "sim":
        from ..cluster import run_scenario

        core, vllm = (run_scenario(s) for s in pair)
    else:
        raise ValueError(f"unknown backend {backend!r}; allowed: sim, nixl")
    return compare_results(scenario.scenario.name, core, vllm), core, vllm
