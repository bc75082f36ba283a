"""Suite-wide collection rules.

``scripts/test`` runs the suite on several pytest-xdist workers. The tests that start real
processes (real NIXL agents in ``tests/nixl``, torchrun launches in ``tests/lab``) go to one
group, so one worker runs them one after another: two of them at once would oversubscribe a
2-core machine with a dozen rank processes and turn their timeouts into failures of load, not
of the code. Everything else spreads over the other workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

#: Test directories, and single files, under tests/ whose tests start several real processes
#: each (rank processes on real NIXL, torchrun launches): one xdist worker runs them all.
REAL_PROCESS_PATHS = ("nixl", "lab", "vllm/test_nixl_backend.py")
REAL_PROCESS_GROUP = "real-processes"

_TESTS = Path(__file__).resolve().parent


def real_process_test(path: Path) -> bool:
    """Whether a test file is, or lies under, one of :data:`REAL_PROCESS_PATHS`."""
    try:
        shown = Path(path).resolve().relative_to(_TESTS).as_posix()
    except ValueError:
        return False
    return any(shown == p or shown.startswith(p + "/") for p in REAL_PROCESS_PATHS)


# tryfirst: on each worker xdist's own hook reads the marker into the node ids it schedules by;
# a conftest hook runs after it unless told otherwise, and then no test would be grouped
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return  # the marker exists only with xdist (--strict-markers)
    for item in items:
        if real_process_test(item.path):
            item.add_marker(pytest.mark.xdist_group(REAL_PROCESS_GROUP))
