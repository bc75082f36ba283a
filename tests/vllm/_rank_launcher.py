"""A rank process of a ``--backend nixl`` run, started by a test instead of by the driver (the
driver's ``spawn_ranks``/``announce`` hooks, as a torchrun launcher would), with one change
planted before the rank starts:

- ``misroute-remote``: the nixl_agent adapter translates every remote descriptor list with the
  addresses rotated by one among descriptors of equal length (each read then comes from
  another block's bytes, all inside registered memory, so NIXL and vLLM see nothing wrong);
- ``no-vllm``: vLLM is not importable in this process (as under a Python without it).

Usage: python _rank_launcher.py PLANT HOST PORT CREDENTIAL ENGINE RANK LOG_PATH
"""

from __future__ import annotations

import sys


def _misroute_remote() -> None:
    import numpy as np

    from hkvsim.implementations.vllm import agent

    real = agent._AddressMap.translate

    def misrouted(self, rows, *, who, what):
        out = real(self, rows, who=who, what=what)
        if who.startswith("remote agent") and out.shape[0] > 1:
            for length in np.unique(out[:, 1]):
                idx = np.flatnonzero(out[:, 1] == length)
                out[idx, 0] = np.roll(out[idx, 0], 1)
        return out

    agent._AddressMap.translate = misrouted


def main(argv: list[str]) -> int:
    plant, host, port, credential, engine, rank, log_path = argv
    if plant == "misroute-remote":
        _misroute_remote()
    elif plant == "no-vllm":
        sys.modules["vllm"] = None  # type: ignore[assignment]
    else:
        raise SystemExit(f"unknown plant {plant!r} (allowed: misroute-remote, no-vllm)")
    from hkvsim.backends.rank import serve_rank

    return serve_rank(host, int(port), credential, engine, int(rank), log_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
