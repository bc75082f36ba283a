"""The environment a lab rank may read: an allow-list, torchrun's variables, and refusals.

A torchrun worker (:mod:`hkvsim.lab`) takes its place in the run from torchrun's variables
(``RANK``, ``LOCAL_RANK``, ...) and nothing else of hkvsim's reads its environment: no setting
travels from the coordinator to a rank (nothing like a launcher that ships the coordinator's
environment to every node). The libraries a rank loads still read their own variables (UCX_*,
NIXL_*, CUDA_*), which is why they are on the allow-list: they are the lab's knobs
(hardware/README.md). A rank started by ``hkvsim run --backend nixl`` gets only allow-listed
variables from its parent driver.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TORCHRUN_VARS", "ALLOWED_NAMES", "ALLOWED_PREFIXES", "EnvError", "TorchrunEnv",
           "allowed", "filter_env", "read_torchrun_env", "check_alloc_conf"]

# what torchrun (torch.distributed.elastic) sets for each worker, and hkvsim reads
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
# read by the libraries a rank loads; hkvsim only checks PYTORCH_CUDA_ALLOC_CONF
ALLOWED_NAMES = frozenset(TORCHRUN_VARS) | {"CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"}
ALLOWED_PREFIXES = ("UCX_", "NIXL_")


class EnvError(ValueError):
    """A variable a lab rank needs is missing or malformed, or one it must refuse is set."""


def allowed(name: str) -> bool:
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def filter_env(env: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of ``env`` (a rank spawned by the driver gets nothing else)."""
    return {k: v for k, v in env.items() if allowed(k)}


@dataclass(frozen=True, kw_only=True)
class TorchrunEnv:
    """One torchrun worker's place in the run."""

    rank: int  # global rank (0 also runs the coordinator)
    world_size: int
    local_rank: int  # on its node: its GPU
    local_world_size: int
    node: int  # torchrun's GROUP_RANK
    master_addr: str  # torchrun's store (the c10d TCPStore)
    master_port: int
    run_id: str
    restart: int
    agent_store: bool  # the store is hosted by torchrun's agent (always under torchrun)

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


def _int(env: Mapping[str, str], name: str, *, low: int = 0) -> int:
    value = env.get(name)
    if value is None:
        raise EnvError(f"{name} is not set: start hkvsim.lab with torchrun (torchrun "
                       f"--nproc-per-node G -m hkvsim.lab SCENARIO; see hardware/README.md)")
    try:
        out = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r:.40} is not an integer") from None
    if out < low:
        raise EnvError(f"{name}={out} must be at least {low}")
    return out


def read_torchrun_env(env: Mapping[str, str] | None = None) -> TorchrunEnv:
    """The worker's place, from torchrun's variables only (``os.environ`` by default)."""
    env = os.environ if env is None else env
    out = TorchrunEnv(
        rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE", low=1),
        local_rank=_int(env, "LOCAL_RANK"), local_world_size=_int(env, "LOCAL_WORLD_SIZE", low=1),
        node=_int(env, "GROUP_RANK"), master_addr=env.get("MASTER_ADDR") or "",
        master_port=_int(env, "MASTER_PORT", low=1), run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")
    if not out.master_addr:
        raise EnvError("MASTER_ADDR is not set: start hkvsim.lab with torchrun")
    if out.rank >= out.world_size or out.local_rank >= out.local_world_size:
        raise EnvError(f"RANK={out.rank} / LOCAL_RANK={out.local_rank} do not fit WORLD_SIZE="
                       f"{out.world_size} / LOCAL_WORLD_SIZE={out.local_world_size}")
    return out


def check_alloc_conf(env: Mapping[str, str] | None = None) -> None:
    """Refuse ``PYTORCH_CUDA_ALLOC_CONF`` with ``expandable_segments:True``: the caching
    allocator then backs tensors with CUDA virtual memory (VMM), which cuda_ipc may not export
    to another process, so a registered VRAM cache could fail to move between GPUs."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for item in conf.replace(";", ",").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
            raise EnvError("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: VMM-backed "
                           "VRAM may not export over cuda_ipc; unset it or set "
                           "expandable_segments:False")
