"""Two agents on the simulated transport, one prefill and one decode endpoint of the shipped CPU
profile: the pair several transport tests post between."""

from __future__ import annotations

from typing import Any

import simpy

from hkvsim.fabric import Fabric, load_profile, place_engines
from hkvsim.transport.sim import SimWorld


def sim_agent_pair() -> tuple[simpy.Environment, Any, Any]:
    """(environment, agent "t-a" on prefill rank 0, agent "t-b" on decode rank 0)."""
    env = simpy.Environment()
    profile = load_profile("cpu-ucx-loopback")
    fabric = Fabric(env, profile, place_engines(profile, [("a", "prefill", 1),
                                                          ("b", "decode", 1)]))
    world = SimWorld(env, fabric)
    return env, world.create_agent("t-a", ("a", 0)), world.create_agent("t-b", ("b", 0))
