"""Real backends: the NIXL run (one OS process per rank), its side channel, and calibration.

Nothing here is imported by the simulator; nixl (and torch, for VRAM) load only inside the rank
processes and the calibration sweep.
"""
