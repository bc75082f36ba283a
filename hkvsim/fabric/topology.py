"""Where engine ranks sit: nodes and GPUs, from a profile's ``placement`` policy.

Placement is deterministic and depends only on the profile and the engine list, in order:

* ``"pack"``: engines fill nodes in the order given; an engine that does not fit in what is left
  of the current node starts a new node (an engine's ranks never straddle nodes).
* ``"split"``: prefill engines are packed from node 0; decode engines are packed from a fresh
  node after the last prefill node, so a prefill and a decode engine never share a node.

Nodes are unbounded: the cluster grows to fit the engines.

:func:`route` names the links a flow between two endpoints crosses (the fabric shares them):

* same endpoint   -> ``<ep>.hbm`` (``local_bandwidth``)
* same node       -> ``<src>.nvl.tx``, ``<dst>.nvl.rx`` (``intra_node_bandwidth`` each)
* different nodes -> ``<src>.nic.tx``, ``<dst>.nic.rx`` (``inter_node_bandwidth`` each)

On a profile with a host copy model (``host_copy_cores``) the copy is not a flow on these links
but CPU work on a core of the initiator's node (:class:`hkvsim.fabric.links.Fabric`); the route
still gives the path's latency and completion overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from hkvsim.fabric.profile import FabricProfile

__all__ = ["PlacementError", "Endpoint", "ROLES", "Route", "place_engines", "route"]

ROLES: Final[tuple[str, ...]] = ("prefill", "decode")


class PlacementError(ValueError):
    """An engine list that cannot be placed on the profile's nodes."""


@dataclass(frozen=True, order=True)
class Endpoint:
    """One GPU (or, on CPU profiles, one process slot): ``gpu`` is the index within ``node``."""

    node: int
    gpu: int

    def __str__(self) -> str:
        return f"n{self.node}g{self.gpu}"


@dataclass(frozen=True)
class Route:
    """The links (name, capacity in bytes/s) a flow crosses, the path's one-way latency and the
    completion overhead (seconds) a transfer pays after its data lands."""

    links: tuple[tuple[str, float], ...]
    latency: float
    completion: float


def route(profile: FabricProfile, a: Endpoint, b: Endpoint) -> Route:
    """How a flow from ``a`` to ``b`` crosses the fabric of ``profile`` (module docstring)."""
    p = profile
    if a == b:
        links: list[tuple[str, float]] = [(f"{a}.hbm", p.local_bandwidth)]
        latency = 0.0
    else:
        if a.node == b.node:
            bw, latency, port = p.intra_node_bandwidth, p.intra_node_latency, "nvl"
        else:
            bw, latency, port = p.inter_node_bandwidth, p.inter_node_latency, "nic"
        links = [(f"{a}.{port}.tx", bw), (f"{b}.{port}.rx", bw)]
    return Route(tuple(links), latency, p.completion_overhead)


class _Packer:
    """Fills nodes left to right; an engine that does not fit starts a new node."""

    def __init__(self, gpus_per_node: int, first_node: int = 0) -> None:
        self.gpus_per_node = gpus_per_node
        self.node = first_node
        self.used = 0

    def place(self, tp: int) -> list[Endpoint]:
        if self.used + tp > self.gpus_per_node:
            self.node += 1
            self.used = 0
        out = [Endpoint(self.node, self.used + r) for r in range(tp)]
        self.used += tp
        return out

    def next_fresh_node(self) -> int:
        """The first node with no engine on it."""
        return self.node + 1 if self.used else self.node


def _validate(profile: FabricProfile, engines: Sequence[tuple[str, str, int]]) -> None:
    seen: set[str] = set()
    for entry in engines:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise PlacementError(f"engine entry {entry!r}: expected (engine_id, role, tp)")
        engine_id, role, tp = entry
        if engine_id in seen:
            raise PlacementError(f"engine id {engine_id!r} appears twice; ids must be unique")
        seen.add(engine_id)
        if role not in ROLES:
            raise PlacementError(
                f"engine {engine_id!r}: role {role!r} is not one of {', '.join(ROLES)}"
            )
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise PlacementError(f"engine {engine_id!r}: tp = {tp!r}: expected an integer >= 1")
        if tp > profile.gpus_per_node:
            raise PlacementError(
                f"engine {engine_id!r}: tp = {tp} does not fit on one node of profile "
                f"{profile.name!r} (gpus_per_node = {profile.gpus_per_node}); an engine's ranks "
                f"must share a node"
            )


def place_engines(
    profile: FabricProfile, engines: Sequence[tuple[str, str, int]]
) -> dict[tuple[str, int], Endpoint]:
    """Give every rank ``(engine_id, rank)`` of ``engines`` (``(engine_id, role, tp)``, in
    order) an :class:`Endpoint`, following ``profile.placement``. Keys come out in input order.
    """
    _validate(profile, engines)
    slots: dict[str, list[Endpoint]] = {}
    if profile.placement == "pack":
        packer = _Packer(profile.gpus_per_node)
        for engine_id, _role, tp in engines:
            slots[engine_id] = packer.place(tp)
    elif profile.placement == "split":
        prefill = _Packer(profile.gpus_per_node)
        for engine_id, role, tp in engines:
            if role == "prefill":
                slots[engine_id] = prefill.place(tp)
        decode = _Packer(profile.gpus_per_node, first_node=prefill.next_fresh_node())
        for engine_id, role, tp in engines:
            if role == "decode":
                slots[engine_id] = decode.place(tp)
    else:  # pragma: no cover - FabricProfile validates placement
        raise PlacementError(f"unknown placement {profile.placement!r}")
    return {
        (engine_id, rank): ep
        for engine_id, _role, _tp in engines
        for rank, ep in enumerate(slots[engine_id])
    }
