"""Running a scenario on the simulated fabric: the default backend's entry point.

The request lifecycle lives in the sans-I/O coordinator (:mod:`hkvsim.pd`), the simpy event loop
that feeds it in :mod:`hkvsim.drivers.sim`; this module keeps the names most callers use::

    from hkvsim.cluster import run_scenario
    result = run_scenario(scenario)            # a hkvsim.pd.records.RunResult
"""

from __future__ import annotations

from .drivers.sim import SimDriver, run_scenario
from .pd.records import RequestRecord, RunResult

__all__ = ["run_scenario", "SimDriver", "RunResult", "RequestRecord"]
