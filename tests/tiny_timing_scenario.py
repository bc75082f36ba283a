"""A timing-only tiny-llama scenario (P TP1 -> D TP``decode_tp``) on the simulator: the driver
several tests of the simulation path inspect."""

from __future__ import annotations

from typing import Any


def tiny_timing_driver(name: str, *, decode_tp: int = 1, requests: int = 1,
                       num_blocks: int | None = None) -> Any:
    """A ``SimDriver`` (timing-only) of ``requests`` 64-token requests."""
    from hkvsim.cluster import SimDriver
    from hkvsim.scenario import parse_scenarios

    blocks = f"num_blocks = {num_blocks}\n" if num_blocks is not None else ""
    text = (f'[scenario]\nname = "{name}"\nseed = 1\n[model]\npreset = "tiny-llama"\n'
            f"[prefill]\ntp = 1\n[decode]\ntp = {decode_tp}\n{blocks}"
            f"[workload]\nrequests = {requests}\nprompt_tokens = 64\nverify = false\n")
    (scenario,) = parse_scenarios(text)
    return SimDriver(scenario, timing_only=True)
