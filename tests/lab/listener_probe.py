"""Run as a torchrun worker: prints the TCP listening sockets of this worker and of its parent
(torchrun's agent, which serves the rendezvous store) as one JSON line ``LISTENERS [...]``."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from listening import listening_addresses  # noqa: E402

print("LISTENERS", json.dumps(listening_addresses([os.getppid(), os.getpid()])), flush=True)
