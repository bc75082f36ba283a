"""Thin event loops that feed the coordinator (:mod:`hkvsim.pd`) and carry out its effects.

``sim``   simulated fabric (simpy virtual time), ranks in process
``nixl``  real NIXL agents, one OS process per rank, asyncio wall-clock time
"""
