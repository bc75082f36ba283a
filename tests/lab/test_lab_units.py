"""The lab path's pieces without torchrun: the environment allow-list, placement and the GPU
count, the store protocol, CUDA device selection order, the allocator refusal, the VRAM
staging region and the gpu-check script's refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import numpy as np
import pytest

from hkvsim.backends.side_channel import ProtocolError
from hkvsim.geometry import build_layout, preset
from hkvsim.lab_env import EnvError, check_alloc_conf, filter_env, read_torchrun_env
from hkvsim.lab_place import PlacementError, Slot, place
from hkvsim.lab_store import LabStore, StoreTimeout, check_run, check_slot
from hkvsim.oracle import Oracle

from .conftest import ROOT

pytestmark = pytest.mark.timeout(120)

TORCHRUN_ENV = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}


# ---- environment --------------------------------------------------------------------------------
def test_a_worker_reads_its_place_from_torchruns_variables_only() -> None:
    env = read_torchrun_env({**TORCHRUN_ENV, "HKVSIM_TOKEN": "x", "AWS_SECRET": "y"})
    assert (env.rank, env.world_size, env.local_rank, env.node) == (2, 4, 0, 1)
    assert env.agent_store and not env.single_node
    with pytest.raises(EnvError, match=r"^RANK is not set: start hkvsim.lab with torchrun"):
        read_torchrun_env({k: v for k, v in TORCHRUN_ENV.items() if k != "RANK"})
    with pytest.raises(EnvError, match=r"LOCAL_RANK='x' is not an integer"):
        read_torchrun_env({**TORCHRUN_ENV, "LOCAL_RANK": "x"})
    with pytest.raises(EnvError, match="do not fit"):
        read_torchrun_env({**TORCHRUN_ENV, "RANK": "4"})
    assert env.restart == 0 and env.run_id == "abc" and env.master_addr == "10.0.0.1"
    assert read_torchrun_env({**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": "3"}).restart == 3
    assert read_torchrun_env({**TORCHRUN_ENV, "TORCHELASTIC_RESTART_COUNT": ""}).restart == 0
    for addr in (None, ""):
        env_without = {k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}
        if addr is not None:
            env_without["MASTER_ADDR"] = addr
        with pytest.raises(EnvError, match=r"^MASTER_ADDR is not set: start hkvsim.lab with "):
            read_torchrun_env(env_without)


def test_only_allow_listed_variables_reach_a_spawned_rank() -> None:
    env = {"UCX_TLS": "rc", "NIXL_LOG_LEVEL": "INFO", "CUDA_VISIBLE_DEVICES": "0,1",
           "LD_PRELOAD": "/tmp/evil.so", "HKVSIM_TOKEN": "secret", "PATH": "/bin", "RANK": "0"}
    assert filter_env(env) == {"UCX_TLS": "rc", "NIXL_LOG_LEVEL": "INFO",
                               "CUDA_VISIBLE_DEVICES": "0,1", "RANK": "0"}


def test_the_driver_and_the_rank_entry_refuse_other_variables() -> None:
    from hkvsim.backends.rank import rank_entry
    from hkvsim.drivers.nixl import NixlDriver, NixlRunError, NixlRunOptions
    from hkvsim.scenario import parse_scenarios

    (scenario,) = parse_scenarios(_TINY)
    with pytest.raises(NixlRunError, match=r"^rank environment: LD_PRELOAD not allowed"):
        NixlDriver(scenario, options=NixlRunOptions(env=(("LD_PRELOAD", "x.so"),
                                                         ("UCX_TLS", "tcp"))))
    assert NixlDriver(scenario, options=NixlRunOptions(env=(("UCX_TLS", "tcp"),))
                      )._rank_env()["UCX_TLS"] == "tcp"
    with pytest.raises(SystemExit, match=r"environment \['LD_PRELOAD'\] not allowed"):
        rank_entry("127.0.0.1", 1, "c", "prefill0", 0, "/dev/null", {"LD_PRELOAD": "x.so"})


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:true",
                                  "max_split_size_mb:128, expandable_segments : True"])
def test_expandable_segments_is_refused(conf: str, monkeypatch) -> None:
    with pytest.raises(EnvError, match=r"^PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True"):
        check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": conf})
    from hkvsim.drivers.nixl import NixlDriver, NixlRunError, NixlRunOptions
    from hkvsim.scenario import parse_scenarios

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    (scenario,) = parse_scenarios(_TINY)
    with pytest.raises(NixlRunError, match="VMM-backed VRAM may not export over cuda_ipc"):
        NixlDriver(scenario, options=NixlRunOptions(device="cuda"))
    NixlDriver(scenario, options=NixlRunOptions(device="cpu"))  # DRAM: irrelevant


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "max_split_size_mb:128"])
def test_other_allocator_settings_pass(conf: str) -> None:
    check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": conf})


def test_hkvsim_lab_outside_torchrun_says_how_to_start_it() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "hkvsim.lab", "x.toml"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("hkvsim.lab: error: RANK is not set: start hkvsim.lab with "
                                  "torchrun (torchrun --nproc-per-node G -m hkvsim.lab SCENARIO; "
                                  "see hardware/README.md)")


# ---- placement and the GPU count ---------------------------------------------------------------
def _slots(nodes: int, per_node: int, gpus: int | None) -> list[Slot]:
    return [Slot(rank=n * per_node + i, node=n, local_rank=i, gpus=gpus)
            for n in range(nodes) for i in range(per_node)]


def test_engines_are_packed_onto_nodes_without_straddling() -> None:
    placed = place([("prefill0", 1), ("decode0", 2)], _slots(2, 2, 8))
    assert [(p.engine, p.tp_rank, p.rank, p.node, p.device) for p in placed] == [
        ("prefill0", 0, 0, 0, 0), ("decode0", 0, 2, 1, 0), ("decode0", 1, 3, 1, 1)]
    placed = place([("prefill0", 2), ("decode0", 4)], _slots(2, 4, 4))
    assert [p.node for p in placed] == [0, 0, 1, 1, 1, 1]
    assert [p.device for p in placed] == [0, 1, 0, 1, 2, 3]
    # larger than any node: it straddles, in node order
    placed = place([("decode0", 3)], _slots(2, 2, None))
    assert [(p.node, p.device) for p in placed] == [(0, 0), (0, 1), (1, 0)]


def test_gpu_count_is_checked_before_placing() -> None:
    # 4 workers per node, but each node has only 2 GPUs: workers 2 and 3 of a node are unusable
    slots = _slots(2, 4, 2)
    placed = place([("prefill0", 2), ("decode0", 2)], slots)
    assert [(p.node, p.device) for p in placed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(PlacementError) as exc:
        place([("prefill0", 1), ("decode0", 4)], slots)
    assert str(exc.value) == ("the variant needs 5 GPU(s), one per rank; 4 worker(s) have one "
                              "(node 0: 4 worker(s), 2 GPU(s), node 1: 4 worker(s), 2 GPU(s))")
    with pytest.raises(PlacementError, match=r"^the variant needs 3 rank process\(es\); "
                                             r"torchrun started 2 "):
        place([("prefill0", 1), ("decode0", 2)], _slots(1, 2, None))


def test_workers_can_share_a_gpu_when_asked() -> None:
    """--ranks-per-gpu 2 on a one-GPU machine (how reports/gpu/ was measured): local ranks 0 and
    1 both use GPU 0, local rank 2 would use GPU 1, which the node does not have."""
    one_gpu = [Slot(rank=i, node=0, local_rank=i, gpus=1, ranks_per_gpu=2) for i in range(3)]
    placed = place([("prefill0", 1), ("decode0", 1)], one_gpu)
    assert [(p.engine, p.rank, p.local_rank, p.device) for p in placed] == [
        ("prefill0", 0, 0, 0), ("decode0", 1, 1, 0)]
    with pytest.raises(PlacementError) as exc:
        place([("prefill0", 1), ("decode0", 2)], one_gpu)
    assert str(exc.value) == ("the variant needs 3 rank(s), 2 per GPU; 2 worker(s) have a GPU "
                              "(node 0: 3 worker(s), 1 GPU(s))")
    # the default stays one worker per GPU: the same machine fits only one rank
    with pytest.raises(PlacementError, match=r"^the variant needs 2 GPU\(s\), one per rank; "
                                             r"1 worker\(s\) have one "):
        place([("prefill0", 1), ("decode0", 1)], _slots(1, 2, 1))
    with pytest.raises(PlacementError, match="ranks per GPU must be at least 1, got 0"):
        Slot(rank=0, node=0, local_rank=0, gpus=1, ranks_per_gpu=0)


def test_hkvsim_lab_refuses_a_ranks_per_gpu_below_one() -> None:
    out = subprocess.run([sys.executable, "-m", "hkvsim.lab", "x.toml", "--ranks-per-gpu", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert ("argument --ranks-per-gpu: a whole number of at least 1 is allowed, got '0'"
            in out.stderr)


# ---- UCX's choice of path for GPU memory -----------------------------------------------------------
UCX_LOGS = ROOT / "tests" / "fixtures" / "ucx"


def test_gpu_reads_by_software_emulation_are_found_in_a_real_ucx_log() -> None:
    """Two decode-rank logs from one H200 (reports/gpu/): by default UCX read the peer's GPU
    memory through tcp/lo (no NVLink, so no cuda_ipc GET); with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
    the same read is cuda_ipc zero-copy. Host-to-GPU tables (emulated in both) do not count."""
    from hkvsim.backends.rank import ucx_emulated_device_rma

    default = (UCX_LOGS / "h200-one-gpu-pull-default.log").read_text()
    assert ucx_emulated_device_rma(default) == [
        "read into cuda/GPU0 from cuda/dev[1]: software emulation over tcp/lo"]
    assert ucx_emulated_device_rma(
        (UCX_LOGS / "h200-one-gpu-pull-get-zcopy.log").read_text()) == []
    assert "host memory to cuda/dev[1]" in default  # emulated, but not GPU to GPU


def test_gpu_emulation_counts_only_gpu_pairs_between_processes() -> None:
    from hkvsim.backends.rank import ucx_emulated_device_rma

    def table(scope: str, header: str, row: str) -> str:
        return (f"[1.0] [vm:1:0]   | d0 {scope} cfg#1 |\n"
                f"[1.0] [vm:1:0]   | remote memory {header} |\n"
                f"[1.0] [vm:1:0]   | Range  | Description | Config |\n"
                f"[1.0] [vm:1:0]   | 0..inf | {row} |\n")
    write = table("inter-node", "write by ucp_put*(multi) from cuda/GPU1 to cuda/dev[3]",
                  "software emulation | tcp/eth0")
    assert ucx_emulated_device_rma(write) == [
        "write from cuda/GPU1 to cuda/dev[3]: software emulation over tcp/eth0"]
    assert ucx_emulated_device_rma(write + write) == [  # once each
        "write from cuda/GPU1 to cuda/dev[3]: software emulation over tcp/eth0"]
    assert ucx_emulated_device_rma(table(
        "self", "read by ucp_get* into cuda/GPU0 from cuda/dev[0]",
        "software emulation | tcp/lo")) == []  # the process's own memory
    assert ucx_emulated_device_rma(table(
        "intra-node", "read by ucp_get* into host memory from cuda/dev[1]",
        "software emulation | tcp/lo")) == []
    zero_copy = table("intra-node", "read by ucp_get* into cuda/GPU0 from cuda/dev[1]",
                      "zero-copy   | rc_mlx5/mlx5_0:1")
    assert ucx_emulated_device_rma(zero_copy) == []
    # a table of another kind after it ends it: its emulated rows are not the GPU read's
    atomic = ("[1.0] [vm:1:0]   | remote memory atomic by ucp_atomic_op* on host memory |\n"
              "[1.0] [vm:1:0]   | 0..inf | software emulation | tcp/lo |\n")
    assert ucx_emulated_device_rma(zero_copy + atomic) == []


def test_a_run_whose_gpu_memory_ucx_emulates_says_so() -> None:
    from types import SimpleNamespace

    from hkvsim.drivers.nixl import NixlDriver

    ranks = [SimpleNamespace(label="decode0 rank 0", emulated=[
                 "read into cuda/GPU0 from cuda/dev[1]: software emulation over tcp/lo"]),
             SimpleNamespace(label="prefill0 rank 0", emulated=[])]
    assert NixlDriver._emulation_warnings(SimpleNamespace(ranks=ranks)) == [
        "decode0 rank 0: UCX moves GPU memory by software emulation, not cuda_ipc or RDMA (read "
        "into cuda/GPU0 from cuda/dev[1]: software emulation over tcp/lo); its transfer times "
        "are not a GPU path's. On a GPU without active NVLink UCX turns cuda_ipc READ off: "
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y turns it on"]


# ---- the store ----------------------------------------------------------------------------------
class DictStore:
    """torch.distributed.Store's set/get/wait over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise RuntimeError(f"timeout waiting for {missing}")


def test_store_values_round_trip_and_are_checked() -> None:
    store = LabStore(DictStore())
    store.put("slot/1", {"op": "slot", "node": 0, "local_rank": 1, "gpus": None})
    assert check_slot(store.take("slot/1", 1.0)) == {"node": 0, "local_rank": 1, "gpus": None}
    run = {"op": "run", "host": "127.0.0.1", "port": 4000, "engine": "decode0", "rank": 1,
           "credential": "ab" * 16}
    store.put("round/0/2", run)
    assert check_run(store.take("round/0/2", 1.0))["engine"] == "decode0"
    with pytest.raises(StoreTimeout, match=r"'round/1/2' did not appear in torchrun's store"):
        store.take("round/1/2", 0.1)


@pytest.mark.parametrize("bad, why", [
    ({"engine": "../../etc/passwd"}, "is not a rank name"),
    ({"engine": "decode0", "rank": -1}, "is not a rank name"),
    ({"port": 0}, "bad coordinator address"),
    ({"env": {"LD_PRELOAD": "x"}}, r"unexpected field\(s\) \['env'\]"),
    ({"port": True}, "must be int, got a bool"),
])
def test_a_malformed_assignment_is_refused(bad: dict, why: str) -> None:
    run = {"op": "run", "host": "127.0.0.1", "port": 4000, "engine": "decode0", "rank": 1,
           "credential": "ab" * 16, **bad}
    with pytest.raises(ProtocolError, match=why):
        check_run(run)


def test_undecodable_store_values_are_refused() -> None:
    import msgpack

    raw = DictStore()
    store = LabStore(raw)
    raw.set("a", b"\xc1\xc1")
    raw.set("b", msgpack.packb([1, 2]))
    raw.set("c", msgpack.packb({"op": "x", "t": msgpack.ExtType(1, b"p")}))
    for key, why in (("a", "not msgpack"), ("b", "must be a map"), ("c", "extension type")):
        with pytest.raises(ProtocolError, match=why):
            store.take(key, 1.0)


# ---- CUDA device selection comes before the NIXL agent ------------------------------------------
def test_a_vram_rank_selects_its_cuda_device_before_creating_the_nixl_agent(monkeypatch) -> None:
    import hkvsim.backends.rank as rank_mod
    import hkvsim.transport.nixl as nixl_mod
    from hkvsim.scenario import parse_scenarios

    calls: list[tuple[str, object]] = []

    class Stop(Exception):
        pass

    def fake_transport(name, **_kw):
        calls.append(("agent", name))
        raise Stop

    monkeypatch.setattr(rank_mod, "select_cuda_device", lambda d: calls.append(("device", d)))
    monkeypatch.setattr(nixl_mod, "NixlTransport", fake_transport)
    (scenario,) = parse_scenarios(_TINY)
    proc = rank_mod.RankProcess(None, credential="c", engine="decode0", rank=1, log_path="x")
    setup = {"op": "setup", "scenario": scenario.to_dict(), "role": "decode", "num_blocks": 64,
             "mem_type": "VRAM", "device_id": 3, "epoch": 0.0, "progress_thread": False,
             "telemetry": False, "oracle": True, "precommit": False}
    with pytest.raises(Stop):
        proc._setup(setup)
    assert calls == [("device", 3), ("agent", "decode0.1")]
    calls.clear()
    with pytest.raises(Stop):
        proc._setup({**setup, "mem_type": "DRAM"})
    assert calls == [("agent", "decode0.1")]  # DRAM: no CUDA at all


def test_select_cuda_device_refuses_expandable_segments_first(monkeypatch) -> None:
    from hkvsim.backends.rank import select_cuda_device

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(EnvError, match="expandable_segments"):
        select_cuda_device(0)


# ---- the VRAM staging region ---------------------------------------------------------------------
def _layout(name: str, tp: int, blocks: int = 12):
    model = preset(name)
    return build_layout(model, tp=tp, block_size=model.attention.attention_backend
                        .min_kernel_block, num_blocks=blocks)


def _blocks(layout, ids_attention, first_state):
    """Attention blocks, and one state block per state group (groups alias the same tensors,
    so each needs its own block)."""
    return {g.group_id: np.array(ids_attention if g.kind == "attention"
                                 else [first_state + g.group_id]) for g in layout.groups}


CASES = [("tiny-kimi-linear", 1), ("tiny-kimi-linear", 2), ("tiny-qwen3-next", 2),
         ("tiny-deepseek", 1), ("tiny-llama", 2)]


@pytest.mark.parametrize("name, tp", CASES)
def test_the_oracle_touches_nothing_outside_the_staging_region(name: str, tp: int) -> None:
    """What a VRAM rank stages (staging_spans) covers every byte the oracle writes or reads
    for the op's blocks: writes land only inside it, and poison outside it changes nothing
    the oracle sees."""
    from hkvsim.backends.rank import staging_spans

    layout = _layout(name, tp)
    oracle = Oracle(layout.model)
    blocks = _blocks(layout, [7, 2, 3], 8)
    tokens = (0, 3 * layout.logical_block_size - 5)
    step = tokens[1] if layout.is_hybrid else None
    spans = staging_spans(layout, blocks)
    inside = np.zeros(layout.total_bytes, bool)
    for a, b in spans:
        inside[a:b] = True
    assert 0 < inside.sum() < layout.total_bytes  # a region, not the whole cache
    memory = np.zeros(layout.total_bytes, np.uint8)
    oracle.write(memory, layout, tp - 1, 5, blocks=blocks, tokens=tokens, state_step=step)
    assert memory[~inside].sum() == 0 and memory[inside].any()
    rng = np.random.default_rng(3)
    poisoned = memory.copy()
    poisoned[~inside] = rng.integers(1, 255, int((~inside).sum()), dtype=np.uint8)
    for arr in (memory, poisoned):
        assert oracle.verify(arr, layout, tp - 1, 5, engine="decode0", blocks=blocks,
                             tokens=tokens, state_step=step) == (0, [])
    # and the region is needed: a corrupted byte inside it is caught
    bad = poisoned.copy()
    bad[spans[0][0]] ^= 0xFF
    assert oracle.verify(bad, layout, tp - 1, 5, engine="decode0", blocks=blocks,
                         tokens=tokens, state_step=step)[0] > 0


def test_staging_spans_merge_adjacent_blocks_and_clip_to_the_tensor() -> None:
    from hkvsim.backends.rank import staging_spans

    layout = _layout("tiny-deepseek", 1, blocks=8)
    page = layout.unified_page_bytes
    spans = staging_spans(layout, {0: np.array([1, 2, 3, 6])})
    assert spans[:2] == [(page, 4 * page), (6 * page, 7 * page)]
    assert len(spans) == 2 * layout.num_tensors
    assert staging_spans(layout, {0: np.array([], dtype=np.int64)}) == []
    last = staging_spans(layout, {0: np.array([7])})
    assert all(b - a == page for a, b in last)


def test_a_vram_rank_stages_only_the_region_and_pushes_back_only_changes(monkeypatch) -> None:
    """The host-staged executor with a CPU torch tensor standing in for VRAM: an oracle write
    copies only its blocks' pages from the 'device' and back, and bytes elsewhere on the
    'device' (a DMA landing meanwhile) are left alone."""
    torch = pytest.importorskip("torch")
    from hkvsim.backends.rank import _HostStagedExecutor, staging_spans
    from hkvsim.pd.ops import OracleWrite, Verify
    from hkvsim.transport.base import Memory

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    layout = _layout("tiny-kimi-linear", 1, blocks=48)
    device = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    shadow = np.zeros(layout.total_bytes, np.uint8)
    memory = Memory(base_addr=0, array=shadow, mem_type="VRAM", device_id=0)

    class Worker:
        pass

    worker = Worker()
    worker.memory, worker.layout = memory, layout

    class Transport:
        def device_tensor(self, m):
            return device if m is memory else None

    executor = _HostStagedExecutor(("decode0", 0), worker, Oracle(layout.model), Transport())
    blocks = _blocks(layout, [4, 5], 7)
    region = sum(b - a for a, b in staging_spans(layout, blocks))
    other = layout.total_bytes - 1  # a byte no op here touches: DMA "landing" on the device
    device[other] = 77
    copies = []  # host arrays handed to torch: one per host<->device copy
    real_from_numpy = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: copies.append(a.size) or real_from_numpy(a))
    executor.execute(OracleWrite(request=2, blocks=blocks, tokens=(0, 40), state_step=40))
    monkeypatch.setattr(torch, "from_numpy", real_from_numpy)
    # the region down, then its values and their changed-mask back: 3x the region at most
    assert executor.staged_bytes <= 3 * region < layout.total_bytes
    # and a handful of copies, not one per run of changed bytes (this write's 381,805 changed
    # bytes come in 145,782 runs: as many copies before, 3 s of CPU per write on the H200)
    spans = staging_spans(layout, blocks)
    assert len(copies) <= 3 * len(spans), len(copies)
    assert int(device[other]) == 77 and shadow[other] == 0  # neither copied nor overwritten
    expected = np.zeros(layout.total_bytes, np.uint8)
    Oracle(layout.model).write(expected, layout, 0, 2, blocks=blocks, tokens=(0, 40),
                               state_step=40)
    expected[other] = 77
    assert np.array_equal(device.numpy(), expected)  # the device holds exactly the pattern
    # verify reads the device's bytes (staged), not a stale shadow
    shadow[:] = 0
    words, _ = executor.execute(Verify(request=2, blocks=blocks, tokens=(0, 40), state_step=40,
                                       zero_tail=None, compute=(40, 40), compute_step=None))
    assert words == 0
    device[staging_spans(layout, blocks)[0][0] + 8] ^= 1  # a wrong byte on the device
    words, _ = executor.execute(Verify(request=2, blocks=blocks, tokens=(0, 40), state_step=40,
                                       zero_tail=None, compute=(40, 40), compute_step=None))
    assert words > 0


def test_a_masked_push_back_leaves_a_dma_landing_inside_the_span_alone(monkeypatch) -> None:
    """Bytes of the staged span that the oracle step did not change keep whatever the device has
    now (a DMA may land there while the step runs), also when the span is cut into pieces."""
    torch = pytest.importorskip("torch")
    import hkvsim.transport.nixl as nixl_transport
    from hkvsim.backends.rank import _HostStagedExecutor
    from hkvsim.transport.base import Memory

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(nixl_transport, "MASKED_CHUNK_BYTES", 64)  # several pieces
    device = torch.zeros(1000, dtype=torch.uint8)
    memory = Memory(base_addr=0, array=np.zeros(1000, np.uint8), mem_type="VRAM", device_id=0)
    worker = type("Worker", (), {})()
    worker.memory = memory

    class Transport:
        def device_tensor(self, m):
            return device if m is memory else None

    executor = _HostStagedExecutor(("decode0", 0), worker, None, Transport())
    executor._spans = [(100, 900)]

    def step(host: np.ndarray) -> None:
        host[110:120] = 5  # this rank's write
        host[700] = 6
        device[705] = 99  # a DMA landing meanwhile, beside a changed byte in the same piece
        device[500] = 97  # in a piece with no change
        device[50] = 98  # outside the span

    executor.access(True, step)
    assert device[110:120].tolist() == [5] * 10 and int(device[700]) == 6
    assert (int(device[705]), int(device[500]), int(device[50])) == (99, 97, 98)
    assert int(device[120]) == 0 and int(device.sum()) == 5 * 10 + 6 + 99 + 97 + 98
    assert executor.staged_bytes == 800 + 2 * (64 * 2)  # down: the span; back: two pieces


# ---- hardware/gpu-check ---------------------------------------------------------------------------
def test_gpu_check_refuses_clearly_without_cuda(tmp_path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot be shown here")
    for extra, needs in (([], "1 GPU(s)"), (["--gpus", "2"], "2 GPU(s)")):
        out = subprocess.run([sys.executable, str(ROOT / "hardware" / "gpu-check"), *extra],
                             capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.startswith("hardware/gpu-check: refused: no CUDA device: "
                                     "torch.cuda.is_available() is False")
        assert f"this check needs {needs}" in out.stderr
        assert not (tmp_path / "reports").exists()  # nothing written where results go


_TINY = """
[scenario]
name = "tiny"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[workload]
requests = 1
prompt_tokens = 100
"""


def test_the_lab_extra_gives_an_importable_nixl_and_matches_ci() -> None:
    """`pip install '.[lab]'`: `nixl` (the package behind `import nixl`, picking nixl_cu12 or
    nixl_cu13 by the CUDA it finds) at the version CI tests, plus torch for VRAM and torchrun."""
    import tomllib

    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["lab"]
    assert "nixl==1.5.1" in lab and "nixl-cu12==1.5.1" in lab
    assert any(r.startswith("torch") for r in lab)
    ci = (ROOT / "scripts" / "test").read_text()
    assert "nixl-cu12==1.5.1 nixl==1.5.1" in ci and "torch==2.13.0" in ci


def test_across_nodes_rank_0_never_binds_loopback_by_guess() -> None:
    import argparse

    from hkvsim.lab import Coordinator

    env = read_torchrun_env({**TORCHRUN_ENV, "RANK": "0", "GROUP_RANK": "0",
                             "MASTER_ADDR": "127.0.0.1"})
    args = argparse.Namespace(bind=None)
    with pytest.raises(EnvError, match=r"several nodes, but the route to torchrun's store "
                                       r"\(127.0.0.1\) leaves from 127.0.0.1; give --bind ADDR"):
        Coordinator(args, env, None, None)._bind_address()
    assert Coordinator(argparse.Namespace(bind="10.1.2.3"), env, None, None)._bind_address() == (
        "10.1.2.3")
    one_node = read_torchrun_env({**TORCHRUN_ENV, "RANK": "0", "LOCAL_RANK": "0",
                                  "WORLD_SIZE": "2", "GROUP_RANK": "0"})
    assert Coordinator(args, one_node, None, None)._bind_address() == "127.0.0.1"


def test_a_rank_that_cannot_reach_the_coordinator_says_so_on_its_own_stderr(tmp_path) -> None:
    """Before its output goes to the rank log: a torchrun worker then fails the run at once
    (hkvsim.lab exits), instead of rank 0 waiting out its startup deadline."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    code = ("import sys; from hkvsim.backends.rank import serve_rank; "
            f"sys.exit(serve_rank('127.0.0.1', {port}, 'c', 'decode0', 1, "
            f"{str(tmp_path / 'r.log')!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    from hkvsim.backends.rank import EXIT_UNREACHABLE

    assert out.returncode == EXIT_UNREACHABLE == 6
    assert out.stderr.startswith(f"rank decode0.1: cannot reach the coordinator at "
                                 f"127.0.0.1:{port}: ")
    assert not (tmp_path / "r.log").exists()


def test_a_rank_logs_to_its_file_only_while_it_serves(tmp_path) -> None:
    """serve_rank sends the process's output to the rank log during a run and gives it back
    afterwards: a torchrun worker's messages in a later round reach torchrun's console, not
    the previous round's log."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    log = tmp_path / "r.log"
    code = ("import sys; from hkvsim.backends.rank import serve_rank\n"
            "print('before', file=sys.stderr, flush=True)\n"
            f"code = serve_rank('127.0.0.1', {port}, 'c', 'decode0', 1, {str(log)!r})\n"
            "print('after', code, file=sys.stderr, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        conn, _ = server.accept()  # a coordinator that goes away before SETUP
        conn.recv(4096)
        conn.close()
        _, err = proc.communicate(timeout=60)
    finally:
        server.close()
        if proc.poll() is None:
            proc.kill()
    from hkvsim.backends.rank import EXIT_LOST

    assert err.splitlines() == ["before", f"after {EXIT_LOST}"]
    assert "no SETUP from the coordinator" in log.read_text()


@pytest.mark.parametrize("bad", [{"op": "run"}, {"node": -1}, {"local_rank": -1}, {"gpus": -1}])
def test_a_malformed_slot_is_refused(bad: dict) -> None:
    good = {"op": "slot", "node": 1, "local_rank": 0, "gpus": 2}
    assert check_slot(good) == {"node": 1, "local_rank": 0, "gpus": 2}
    with pytest.raises(ProtocolError, match=r"^malformed slot "):
        check_slot({**good, **bad})


def test_an_oversized_store_value_is_refused_both_ways() -> None:
    import msgpack

    from hkvsim.lab_store import MAX_VALUE

    raw = DictStore()
    store = LabStore(raw)
    big = {"op": "slot", "pad": "x" * MAX_VALUE}
    with pytest.raises(ProtocolError, match=r"^store value 'slot/0' is \d+ B, over "):
        store.put("slot/0", big)
    assert "slot/0" not in raw.data
    raw.data["slot/0"] = msgpack.packb(big)  # written by someone else
    with pytest.raises(ProtocolError, match=r"^store value 'slot/0' is \d+ B, over "):
        store.take("slot/0", 1.0)


def test_gpu_check_lists_each_variants_run_warnings_under_its_step() -> None:
    from hkvsim.lab_check import _markdown, run_warnings

    emulated = "decode0 rank 0: UCX moves GPU memory by software emulation (...)"
    data = {"scenarios": [
        {"sweep_point": {"connector.mode": "pull"}, "warnings": [emulated, emulated]},
        {"sweep_point": {"connector.mode": "push"}, "warnings": []}]}
    assert run_warnings(data) == [f"connector.mode=pull: {emulated}"]
    assert run_warnings({"warnings": ["w"]}) == ["w"]  # one file without a sweep
    assert run_warnings(None) == []
    text = _markdown({"when": "t", "device": "cuda", "host": "h", "steps": {
        "pull and push": {"ok": True, "problems": [], "warnings": run_warnings(data)}}})
    assert (f"- **pull and push**: passed\n  - warning: connector.mode=pull: {emulated}\n"
            in text)


def test_gpu_check_shares_the_gpu_only_when_there_is_one() -> None:
    from hkvsim.lab_check import gpu_placement

    assert gpu_placement("cuda", 1) == (
        2, "P and D both on GPU 0: the copy stays inside one device")
    assert gpu_placement("cuda", 2) == (1, "P on GPU 0, D on GPU 1")
    assert gpu_placement("cpu", 2) == (1, "P and D in DRAM")


def test_a_one_gpu_gpu_check_says_the_copy_never_left_the_device() -> None:
    """reports/gpu/ was measured on one GPU: the summary must say that P and D shared it, and
    the calibration table must not pass off an NVLink profile's figure as predicting it."""
    from hkvsim.lab_check import _markdown

    row = {"variant": 0, "point": {"workload.prompt_tokens": 1024}, "bytes": 10,
           "descriptors": 2, "measured_p50_s": 0.002, "simulated_p50_s": 0.001, "error": -0.5}
    base = {"when": "t", "device": "cuda", "host": "h", "steps": {
        "vram registration": {"ok": True}, "calibration sweep": {
            "ok": False, "problems": ["torchrun exit status 1"]}}, "calibration": [row]}
    one = _markdown({**base, "gpus": 1, "placement": "P and D both on GPU 0: the copy stays "
                     "inside one device"})
    assert "- GPUs used: 1 (P and D both on GPU 0: the copy stays inside one device)" in one
    assert "here both ran on one GPU, so the measured copy never left the device" in one
    assert "- **calibration sweep**: FAILED -- torchrun exit status 1" in one
    assert "| 0 | {\"workload.prompt_tokens\": 1024} | 10 | 2 | 2.000 ms | 1.000 ms | -50 % |" in one
    two = _markdown({**base, "gpus": 2, "placement": "P on GPU 0, D on GPU 1"})
    assert "never left the device" not in two and "- GPUs used: 2 (P on GPU 0, D on GPU 1)" in two


def test_a_timed_out_step_kills_what_holds_its_output_after_its_parent_is_gone(tmp_path) -> None:
    """In CI a rank process that a worker started after the tree was listed outlived it,
    re-parented, and kept the step's output pipe open: reading it hung. Whatever still holds
    the pipes is killed too."""
    import os
    import time

    from hkvsim.lab_check import _kill_tree

    marker = tmp_path / "late.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "def late(*_):\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"    open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, late)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    _kill_tree(proc, grace=2.0)
    late = int(marker.read_text())
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            state = open(f"/proc/{late}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the late process survived holding the pipe")
    out, _ = proc.communicate(timeout=5)  # nothing holds the pipe any more: this returns


def test_a_timed_out_step_kills_workers_in_sessions_of_their_own(tmp_path) -> None:
    """torchrun starts its workers in new sessions: killing its process group would leave them.
    The timeout kills the whole tree, even what outlives its parent's SIGTERM."""
    import os
    import time

    from hkvsim.lab_check import _kill_tree

    marker = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], text=True)
    end = time.monotonic() + 20
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < end, "the grandchild did not start"
        time.sleep(0.05)
    grandchild = int(marker.read_text())
    _kill_tree(proc, grace=0.5)
    proc.wait(5)
    end = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < end:
        state = open(f"/proc/{grandchild}/stat").read().rsplit(")", 1)[1].split()[0]
        if state == "Z":  # killed, waiting for its (re)parent to reap it
            break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{grandchild}"), "the grandchild survived"


def test_a_zombie_counts_as_gone() -> None:
    """A killed process its parent has not reaped yet is dead: the timeout's kill loop must not
    wait for it."""
    import os
    import time

    from hkvsim.lab_check import _started

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    end = time.monotonic() + 20
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < end, "the child did not exit"
        time.sleep(0.05)
    assert _started(child.pid) is None
    child.wait(5)
    assert _started(os.getpid()) is not None


def test_a_rank_reports_what_ucx_emulated_when_it_shuts_down() -> None:
    """The shutdown reply carries, from the rank's own log, the transports and the GPU RMA
    UCX emulated: the driver's warning is built from it."""
    from types import SimpleNamespace

    from hkvsim.backends.rank import RankProcess

    sent = []
    proc = RankProcess.__new__(RankProcess)
    proc.log_path = str(UCX_LOGS / "h200-one-gpu-pull-default.log")
    proc._shutdown_worker = lambda: 0
    proc._close_transport = lambda: {}
    proc._send_quietly = sent.append
    proc._shutdown({"op": "shutdown", "seq": 7})
    (reply,) = sent
    assert reply["seq"] == 7 and reply["transports"] == ["cma/memory", "tcp/lo"]
    assert reply["emulated"] == [
        "read into cuda/GPU0 from cuda/dev[1]: software emulation over tcp/lo"]
    proc.log_path = str(UCX_LOGS / "no-such.log")  # unreadable: nothing claimed
    proc._shutdown({"op": "shutdown", "seq": 8})
    assert (sent[-1]["transports"], sent[-1]["emulated"]) == ([], [])


@pytest.mark.parametrize("argv, thread", [
    (["--device", "cuda"], True),  # a GPU lab runs NIXL as vLLM does
    (["--device", "cuda", "--no-progress-thread"], False),
    (["--device", "cpu"], False),  # a 2-core CI box: the ranks poll NIXL themselves
    (["--device", "cpu", "--progress-thread"], True),
])
def test_gpu_check_runs_nixls_progress_thread_as_its_device_calls_for(
        argv: list[str], thread: bool, tmp_path, monkeypatch) -> None:
    from hkvsim import lab_check

    seen: dict[str, list] = {"torchrun": [], "probe": []}
    monkeypatch.setattr(lab_check, "preflight", lambda device, gpus: [])
    monkeypatch.setattr(lab_check, "vram_registration", lambda devices: {"ok": True,
                                                                         "devices": []})
    monkeypatch.setattr(lab_check, "_visible_gpus", lambda: 1)

    def torchrun(scenario, **kwargs):
        seen["torchrun"].append(kwargs["progress_thread"])
        seen.setdefault("workers", []).append((scenario.name, kwargs["nproc"],
                                               kwargs["ranks_per_gpu"]))
        return 0, None, ""

    def probe(**kwargs):
        seen["probe"].append(kwargs["progress_thread"])
        raise RuntimeError("not run here")

    monkeypatch.setattr(lab_check, "torchrun_json", torchrun)
    monkeypatch.setattr("hkvsim.backends.progress_probe.run_probe", probe)
    lab_check.main([*argv, "--skip-sweep", "--skip-calibration", "--out", str(tmp_path)])
    workers = seen.pop("workers")
    assert seen == {"torchrun": [thread, thread], "probe": [thread]}
    # on one GPU both pull-push ranks share it, and all eight TP-pair workers do
    share = 1 if "cpu" in argv else 2
    assert workers == [("gpu-pull-push.toml", 2, share),
                       ("gpu-tp-pairs.toml", 8, 1 if "cpu" in argv else 8)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["progress_thread"] is thread
    memory = "VRAM" if "cuda" in argv else "DRAM"
    assert summary["steps"][f"progress probe ({memory})"] == {"ok": False,
                                                              "problems": ["not run here"]}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("thread", [False, True])
def test_gpu_checks_torchrun_step_passes_the_progress_thread_to_every_rank(
        thread: bool, device: str, monkeypatch, tmp_path) -> None:
    """Said either way: hkvsim.lab defaults to on with cuda, so leaving the flag out would turn
    `gpu-check --no-progress-thread` back on in every rank."""
    from pathlib import Path

    from hkvsim import lab_check
    from hkvsim.lab import parse_args as lab_parse

    commands: list[list[str]] = []

    class Done:
        returncode = 0

        def __init__(self, cmd, **kwargs) -> None:
            commands.append(cmd)

        def communicate(self, timeout=None):
            return '{"outcome": "ok"}', ""

    monkeypatch.setattr(lab_check.subprocess, "Popen", Done)
    code, data, _ = lab_check.torchrun_json(Path("s.toml"), nproc=2, device=device,
                                            log_dir=tmp_path, timeout=5.0,
                                            progress_thread=thread)
    assert (code, data) == (0, {"outcome": "ok"})
    (cmd,) = commands
    assert cmd[cmd.index("-m", cmd.index("--nproc-per-node")) + 1] == "hkvsim.lab"
    flag = "--progress-thread" if thread else "--no-progress-thread"
    assert [a for a in cmd if a.endswith("progress-thread")] == [flag]
    assert lab_parse(cmd[cmd.index("hkvsim.lab") + 1:]).progress_thread is thread


@pytest.mark.parametrize("argv, thread", [
    (["s.toml", "--device", "cuda"], True), (["s.toml"], False),
    (["s.toml", "--device", "cuda", "--no-progress-thread"], False),
    (["s.toml", "--progress-thread"], True)])
def test_hkvsim_lab_runs_nixls_progress_thread_on_gpus_by_default(argv, thread) -> None:
    """On GPUs the lab runs NIXL as vLLM's connector does (progress thread on): with it off a
    notified transfer completes only when its remote rank next calls into NIXL, and a remote
    busy with oracle work held every GPU transfer of the calibration sweep for up to 3 s."""
    from hkvsim.lab import parse_args

    assert parse_args(argv).progress_thread is thread


def test_gpu_checks_tp_pairs_fit_its_eight_workers_and_cover_unequal_tp() -> None:
    from hkvsim.lab_check import SCENARIOS, TP_PAIR_WORKERS
    from hkvsim.scenario import load_scenarios

    variants = load_scenarios(str(SCENARIOS / "gpu-tp-pairs.toml"))
    pairs = {(v.prefill.tp, v.decode.tp, v.connector.mode) for v in variants}
    assert len(variants) == len(pairs) == 18
    assert max(p + d for p, d, _ in pairs) == TP_PAIR_WORKERS
    assert {(1, 4, "pull"), (4, 1, "push"), (2, 4, "pull")} <= pairs
    assert {v.model.preset for v in variants} == {"tiny-kimi-linear"}
