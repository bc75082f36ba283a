"""The simulated fabric: profiles, placement and link-sharing in simpy virtual time.

Only time is modelled here (seconds as floats); the transport layer moves the bytes. Nothing in
this package holds global state: every :class:`Fabric` belongs to the ``simpy.Environment`` it is
given.
"""

from hkvsim.fabric.links import Fabric, FabricError, LinkSegment, TransferTiming
from hkvsim.fabric.profile import (
    MEMORY_KINDS,
    PLACEMENTS,
    PROFILE_DIR,
    TOML_KEYS,
    FabricProfile,
    ProfileError,
    load_profile,
    profile_names,
)
from hkvsim.fabric.topology import ROLES, Endpoint, PlacementError, place_engines

__all__ = [
    "Endpoint",
    "Fabric",
    "FabricError",
    "FabricProfile",
    "LinkSegment",
    "MEMORY_KINDS",
    "PLACEMENTS",
    "PROFILE_DIR",
    "PlacementError",
    "ProfileError",
    "ROLES",
    "TOML_KEYS",
    "TransferTiming",
    "load_profile",
    "place_engines",
    "profile_names",
]
