"""Every socket a real-NIXL run listens on is on loopback: the coordinator's side channel and each
rank's UCX tcp interfaces (UCX listens on every network device it uses; the agents hkvsim creates
restrict it to lo, ``NixlConfig.net_devices``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "lab"))
from listening import is_loopback_address, listening_addresses  # noqa: E402

pytestmark = [pytest.mark.usefixtures("nixl_required"), pytest.mark.timeout(120)]


def _process_tree(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def test_a_nixl_run_listens_on_loopback_only() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "hkvsim"), "run",
                             str(ROOT / "scenarios" / "validation" / "deepseek-pull-2to4-off.toml"),
                             "--backend", "nixl"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    seen: set[str] = set()
    most = 0
    while proc.poll() is None:
        tree = _process_tree(proc.pid)
        most = max(most, len(tree))
        seen.update(listening_addresses(tree))
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert most >= 7, most  # the driver and its six rank processes were sampled
    assert len(seen) >= 7, seen  # the side channel and every rank's UCX interface
    assert all(is_loopback_address(a) for a in seen), sorted(seen)
