"""Choosing vLLM's connector for a deployment (``[connector] implementation = "vllm"``).

The simulated driver asks :func:`vllm_worker_factory` for the worker class of every rank; the
coordinator, fabric and oracle stay hkvsim's. Every reason vLLM cannot run a scenario is one
:class:`ScenarioError` line naming ``connector.implementation``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...pd.deployment import Deployment
from ...scenario import ScenarioError

__all__ = ["vllm_worker_factory", "undriven_abort_warnings"]

log = logging.getLogger("hkvsim.vllm")

_KEY = "connector.implementation"


def vllm_worker_factory(dep: Deployment, *, now: Callable[[], float], moves_bytes: bool
                        ) -> tuple[Callable[..., Any], dict[str, str]]:
    """(a ConnectorWorker-shaped factory running vLLM's worker, {"name", "version"})."""
    from .engine import VllmHarness, VllmUnavailable, load_vllm, unsupported

    scenario = dep.scenario
    source = scenario.source
    try:
        version = load_vllm()
    except VllmUnavailable as exc:
        raise ScenarioError(str(exc), source=source, key=_KEY) from None
    why = unsupported(dep.model, scenario.connector.mode, version)
    if why is None and not moves_bytes:
        why = ("vLLM's connector needs real cache bytes: run with the oracle (workload.verify = "
               "true, no --timing-only)")
    if why is None:
        for spec in dep.all_engines():
            if spec.layout.physical_blocks_per_logical != 1 and not dep.model.is_hybrid:
                why = (f"engine {spec.engine_id}: the logical block must equal the kernel block "
                       f"({spec.layout.kernel_block_size} tokens) with vLLM's connector today")
                break
    if why is None:
        for spec in dep.all_engines():
            attn = spec.layout.model.attention
            if attn.stored_dtype == "fp8_ds_mla" and (
                    attn.kv_lora_rank, attn.rope_dim) != (512, 64):
                why = (f"engine {spec.engine_id}: vLLM's fp8_ds_mla cache is DeepSeek's 656-byte "
                       f"row (kv_lora_rank 512, rope 64); {spec.layout.model.name} has "
                       f"{attn.kv_lora_rank} and {attn.rope_dim}: use cache_dtype fp8 or the "
                       "model's dtype")
                break
    if why is None and dep.quirks:
        why = "quirks replay hkvsim's model of old connector bugs; they do not apply to vLLM"
    if why is not None:
        raise ScenarioError(why, source=source, key=_KEY)
    from .worker import VllmConnectorWorker

    harness = VllmHarness(now)
    harness.source = source
    harness.mode = scenario.connector.mode
    # each engine's prefix cache, as its vLLM config says (vLLM's rule V4 reads it)
    harness.prefix_caching = {role: getattr(scenario, role).prefix_caching
                              for role in ("prefill", "decode")}

    def make(**kw: Any) -> VllmConnectorWorker:
        return VllmConnectorWorker(harness=harness, **kw)

    return make, {"name": "vllm", "version": version}


def undriven_abort_warnings(scenario: Any) -> list[str]:
    """vLLM's push, decode aborting before scheduling or during the handshake: vLLM's own decode
    path for it (its push scheduler) is not driven; hkvsim's coordinator registers the request
    with no blocks, which vLLM's prefill refuses, and prefill frees the request's blocks at its
    lease. Said in the run's warnings, not left to be read as what vLLM does."""
    connector = scenario.connector
    if connector.implementation != "vllm" or connector.mode != "push":
        return []
    phases = sorted({f.phase for f in scenario.faults if f.kind == "abort-request"
                     and f.phase in ("before-scheduling", "during-handshake")})
    out = [f"{scenario.where}: implementation 'vllm', push: decode aborting "
           f"{p.replace('-', ' ')} is not driven through vLLM's own decode path (hkvsim's "
           f"coordinator registers the request with no blocks, which vLLM's prefill refuses); "
           f"prefill frees the request's blocks at its lease" for p in phases]
    for message in out:
        log.warning("%s", message)
    return out
