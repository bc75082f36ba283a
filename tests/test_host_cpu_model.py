"""The host-path model's process behaviour (hkvsim/fabric/links.py, drivers/sim.py,
transport/sim.py): a cma transfer completes once the remote rank has polled NIXL since the post,
a notification is seen at the receiver's next poll, a rank's one thread notices completions
after its other work, the coordinator's CPU serialises its calls; and the CPU accounting the
real ranks report (hkvsim/pd/cpu.py) with what calibrate --host derives from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import simpy

from host_profiles import CPU_BASE

from hkvsim.fabric import Endpoint, Fabric, load_profile
from hkvsim.pd.cpu import LongOps, RankCpu, merge_rank_cpu

ROOT = Path(__file__).resolve().parents[1]
CPU = str(CPU_BASE)  # the shipped profile without its host-path block
HOST = {"host_copy_cores": 2, "host_copy_core_gbps": 1.0}
PEER = {"peer_poll_idle_us": 1000.0, "peer_poll_busy_us": 100.0}


def _fabric(overrides: dict[str, Any], names: str = "abcd") -> tuple[simpy.Environment, Fabric]:
    env = simpy.Environment()
    p = load_profile(CPU, overrides=overrides)
    return env, Fabric(env, p, {k: Endpoint(0, i) for i, k in enumerate(names)})


# ---- the remote's progress -------------------------------------------------------------------
@pytest.mark.parametrize("progress_at, waits", [(5e-3, True), (0.0, False)])
def test_completion_waits_for_the_remote_to_progress(progress_at: float, waits: bool) -> None:
    env, fabric = _fabric({**HOST, **PEER})
    asked: list[float] = []

    def peer(after: float) -> float:
        asked.append(after)
        return progress_at

    ev = fabric.transfer(initiator="a", src="b", dst="a", nbytes=10**6, descriptors=1,
                         peer_progress=peer)
    env.run()
    t = ev.value
    assert asked == [t.post_start]  # progress counted from the post, asked once the copy ended
    latency = fabric.profile.intra_node_latency
    expected = (progress_at if waits else t.wire_end) + latency
    assert t.done == pytest.approx(expected, rel=1e-9)
    assert t.wire_time == pytest.approx(1e-3, rel=1e-9)  # the copy itself: 1 MB / 1 GB/s


def test_the_copy_is_inside_the_post_call() -> None:
    """On cma the initiating rank copies inside its post call, and NIXL's telemetry counts the
    copy in the post (real 8.2 MB READs: 4.0-5.0 ms posts with ~0 after them); the simulated
    telemetry must split the phases the same way, whatever the totals."""
    env, fabric = _fabric({**HOST, **PEER})
    ev = fabric.transfer(initiator="a", src="b", dst="a", nbytes=10**6, descriptors=1,
                         peer_progress=lambda after: 5e-3)
    env.run()
    t = ev.value
    post_cost = fabric.profile.post_time(1)
    assert t.post_end == t.wire_end
    assert t.post_time == pytest.approx(post_cost + 1e-3, rel=1e-9)
    assert t.wire_start == pytest.approx(t.post_start + post_cost, rel=1e-9)
    assert t.done - t.post_end == pytest.approx(
        5e-3 + fabric.profile.intra_node_latency - t.post_end, rel=1e-9)


def _driver(file: str, overrides: dict[str, Any]) -> Any:
    from hkvsim.drivers.sim import SimDriver
    from hkvsim.scenario import load_scenarios
    from hkvsim.validate import with_profile

    scenario = load_scenarios(ROOT / file)[0]
    return SimDriver(with_profile(scenario, CPU_BASE, overrides))


def test_peer_progress_is_the_expected_next_poll_of_the_remote_rank() -> None:
    d = _driver("scenarios/validation/llama-pull-1to1-strided.toml", {**HOST, **PEER})
    prefill = next(a for a, r in d._agent_rank.items() if r[0].startswith("prefill"))
    rank = d._agent_rank[prefill]
    idle = 1e-3
    d._woken[rank] = 0.0
    # now (0) before `after`: the poll falls uniformly in [after, after + period]
    assert d._peer_progress(prefill, 2e-3) == pytest.approx(2e-3 + idle / 2)
    # woken by a coordinator message at or after `after`: it progressed then
    d._woken[rank] = 3e-3
    assert d._peer_progress(prefill, 2e-3) == 3e-3
    # asked later, within the window: E[max(now, U)] for U uniform on [after, after + period]
    d._woken[rank] = 0.0
    d.env.run(until=2.5e-3)
    assert d._peer_progress(prefill, 2e-3) == pytest.approx(2.5e-3 + (0.5e-3) ** 2 / (2 * idle))
    # the median for an either-or decision: half the window gone -> it has polled, else not
    assert d._peer_progress(prefill, 2e-3, median=True) == pytest.approx(2e-3 + idle / 2)
    d.env.run(until=2.6e-3)
    assert d._peer_progress(prefill, 2e-3, median=True) == pytest.approx(2.6e-3)
    assert d._peer_progress(prefill, 2e-3) > 2.6e-3  # the mean: a hair later
    d.env.run(until=4e-3)  # past the window: it has polled by now
    assert d._peer_progress(prefill, 2e-3) == pytest.approx(4e-3)
    assert d._peer_progress(prefill, 2e-3, median=True) == pytest.approx(4e-3)


def test_small_pulls_wait_for_the_idle_prefill_rank_large_ones_do_not() -> None:
    """What real NIXL 1.5.1 shows on cma (reports/fidelity): a READ whose copy ends before the
    idle prefill rank's next poll completes at that poll; one whose copy spans a poll does not
    wait."""
    from hkvsim.results import result_json

    base = {**HOST, "host_copy_core_gbps": 5.0}
    lags = []
    for overrides in (base, {**base, **PEER}):
        data = result_json(_driver("scenarios/validation/llama-pull-1to1-strided.toml",
                                   overrides).run(), requests=True)
        lags.append([t["transfer_seconds"] for r in data["request_details"]
                     for t in r["telemetry"]])
    without, with_peer = lags
    telemetry = [t for r in data["request_details"] for t in r["telemetry"]]
    for before, after, t in zip(without, with_peer, telemetry):
        copy = t["nbytes"] / 5e9
        assert t["post_seconds"] > copy  # the copy runs inside the post call
        assert before == pytest.approx(1e-7, rel=1e-6)  # after the call: the path latency only
        if copy < 0.3e-3:  # short copies: a wait for the prefill rank's poll, below 1 ms
            assert 50e-6 < after < 1e-3 + 1e-7
    assert sum(with_peer) > sum(without) + 0.5e-3


def test_a_notification_is_seen_at_the_receivers_next_poll() -> None:
    from hkvsim.transport.sim import SimWorld

    env, fabric = _fabric({**HOST, **PEER})
    world = SimWorld(env, fabric)
    world.create_agent("a.0", "a")
    world.create_agent("b.0", "b")
    seen: list[float] = []
    world.on_activity("b.0", lambda: seen.append(env.now))
    world.peer_progress = lambda agent, after: after + 0.5e-3 if agent == "b.0" else after
    world.send("a.0", "b.0", b"done")
    env.run()
    arrival = fabric.path_latency("a", "b") + fabric.profile.notification_latency
    assert seen == [pytest.approx(arrival + 0.5e-3)]
    world.peer_progress = None  # without the model: seen on arrival
    seen.clear()
    world.send("a.0", "b.0", b"again")
    start = env.now
    env.run()
    assert seen == [pytest.approx(start + arrival)]


# ---- one thread per rank, one for the coordinator --------------------------------------------
def test_a_rank_notices_a_completion_after_its_queued_posts() -> None:
    env, fabric = _fabric({**HOST, "completion_notice_us": 100.0})
    first = fabric.transfer(initiator="a", src="a", dst="b", nbytes=10**6, descriptors=1)
    second = fabric.transfer(initiator="a", src="a", dst="c", nbytes=10**7, descriptors=1)
    env.run()
    one, two = first.value, second.value
    # two cores free, but one thread: the second post and copy run before the first notice
    assert two.post_start == pytest.approx(one.wire_end)
    assert one.done == pytest.approx(two.wire_end + 100e-6, rel=1e-9)


def test_oracle_work_holds_the_ranks_thread() -> None:
    env, fabric = _fabric({**HOST, "host_copy_cores": 4})
    work = fabric.cpu_work("a", 1e-3)  # e.g. the oracle checking the previous request
    ev = fabric.transfer(initiator="a", src="a", dst="b", nbytes=10**6, descriptors=1)
    other = fabric.transfer(initiator="c", src="c", dst="d", nbytes=10**6, descriptors=1)
    env.run()
    assert work.processed
    assert ev.value.post_start == pytest.approx(1e-3)  # free cores, but a's thread was busy
    assert other.value.post_start == 0.0


def test_transfers_from_raw_descriptors_dispatch_longer() -> None:
    env, fabric = _fabric({**HOST, "rank_dispatch_us": 100.0,
                           "rank_dispatch_unprepped_us": 700.0})
    prepped = fabric.transfer(initiator="a", src="a", dst="b", nbytes=10, descriptors=1)
    raw = fabric.transfer(initiator="c", src="c", dst="d", nbytes=10, descriptors=1,
                          unprepped=True)
    env.run()
    assert prepped.value.post_start == pytest.approx(100e-6)
    assert raw.value.post_start == pytest.approx(700e-6)
    env, fabric = _fabric({**HOST, "rank_dispatch_us": 100.0})  # no split: one dispatch
    raw = fabric.transfer(initiator="c", src="c", dst="d", nbytes=10, descriptors=1,
                          unprepped=True)
    env.run()
    assert raw.value.post_start == pytest.approx(100e-6)


def test_the_simulator_marks_merged_transfers_unprepped() -> None:
    from hkvsim.results import result_json

    base = {**HOST, "host_copy_core_gbps": 5.0, "rank_dispatch_us": 100.0}
    for file, merged in (("scenarios/validation/kl-pull-1to2-off.toml", False),
                         ("scenarios/fit/deepseek-pull-1to4-contiguous.toml", True)):
        times = []
        for extra in ({}, {"rank_dispatch_unprepped_us": 900.0}):
            data = result_json(_driver(file, {**base, **extra}).run(), requests=True)
            times.append([t["submitted"] for r in data["request_details"]
                          for t in r["telemetry"]])
            times[-1] = data["request_details"][-1]["times"]["transfer_done"]
        assert (times[1] > times[0]) is merged, file


def test_the_coordinators_work_is_serial() -> None:
    env, fabric = _fabric({**HOST, "host_copy_cores": 4})
    done = [fabric.coordinator_work(1e-3) for _ in range(3)]
    env.run()
    assert [e.processed for e in done] == [True] * 3
    assert env.now == pytest.approx(3e-3)  # four cores, still one after the other


def test_the_coordinator_reaches_a_requests_ranks_one_after_another() -> None:
    from hkvsim.results import result_json

    base = {**HOST, "host_copy_core_gbps": 5.0}
    subs = []
    for overrides in (base, {**base, "coordinator_call_us": 200.0}):
        data = result_json(_driver("scenarios/validation/kl-pull-1to2-off.toml",
                                   overrides).run(), requests=True)
        assert data["outcome"] == "ok" and data["verification"] == "verified"
        subs.append([sorted(t["submitted"] for t in r["telemetry"])
                     for r in data["request_details"]])
    plain, serial = subs
    assert all(b - a == 0.0 for a, b in plain)  # both decode ranks start together
    assert all(b - a >= 200e-6 - 1e-12 for a, b in serial)  # the second call came later


def test_host_model_keys_are_checked() -> None:
    from hkvsim.fabric import ProfileError

    for overrides, fragment in (
            ({"peer_poll_idle_us": 1000.0}, "go together"),
            ({"peer_poll_idle_us": 1000.0, "peer_poll_busy_us": 100.0},
             "'peer_poll_idle_us' without 'host_copy_cores'"),
            ({"coordinator_call_us": 10.0}, "'coordinator_call_us' without 'host_copy_cores'")):
        with pytest.raises(ProfileError, match=fragment):
            load_profile(CPU, overrides=overrides)


# ---- CPU accounting ----------------------------------------------------------------------------
def test_rank_cpu_adds_up_per_operation_and_merges() -> None:
    a, b = RankCpu(), RankCpu()
    a.add_op("StartRead", 0.002)
    a.add_op("Verify", 0.004, oracle=1000)
    a.add_post(0.001)
    b.add_op("StartRead", 0.001)
    b.add_post(0.0005)
    merged = merge_rank_cpu([a.to_wire(), b.to_wire(),
                             {**RankCpu().to_wire(),
                              "coordinator": {"calls": 4, "cpu_seconds": 0.002}}])
    assert merged["by_op"]["StartRead"] == [2, pytest.approx(0.003), 0]
    assert merged["by_op"]["Verify"] == [1, pytest.approx(0.004), 1000]
    assert (merged["posts"], merged["post_cpu_seconds"]) == (2, pytest.approx(0.0015))
    assert merged["coordinator"] == {"calls": 4, "cpu_seconds": pytest.approx(0.002)}
    assert "coordinator" not in merge_rank_cpu([a.to_wire()])
    with pytest.raises(ValueError, match="rank CPU record .*allowed"):
        merge_rank_cpu([{"by_op": {"StartRead": [1, 0.1]}, "posts": 1, "post_cpu_seconds": 0}])


def _with_rank_cpu(rank_cpu: dict[str, Any]) -> Any:
    """A held-out/FIT file result carrying only ``rank_cpu`` (what the calibration reads)."""
    from hkvsim.validate import FileResult

    return FileResult(file="f", scenario="s", profile=CPU, sim_seconds=1e-3,
                      real_seconds=(1e-3,), loads=(0.1,), descriptors_posted=(1, 1),
                      descriptors_coalesced=(1, 1), outcomes=("ok", "ok"), rank_cpu=rank_cpu)


def test_calibration_derives_dispatch_oracle_and_coordinator_from_the_real_ranks() -> None:
    from hkvsim.validate import FileResult, ValidationError
    from hkvsim.validate_fit import measured_cpu

    def result(rank_cpu: dict[str, Any]) -> FileResult:
        return _with_rank_cpu(rank_cpu)

    one = {"by_op": {"StartRead": [10, 0.010, 0], "StartWrite": [2, 0.004, 0],
                     "OracleWrite": [5, 0.002, 4_000_000], "Verify": [5, 0.002, 4_000_000],
                     "Connect": [1, 0.5, 0]},
           "posts": 20, "post_cpu_seconds": 0.006,
           "coordinator": {"calls": 50, "cpu_seconds": 0.010}}
    cpu = measured_cpu([result(one), result(one)])
    assert cpu["rank_dispatch_us"] == pytest.approx((0.028 - 0.012) / 40 * 1e6)  # 400 us
    assert cpu["oracle_core_gbps"] == pytest.approx(16e6 / 0.008 / 1e9)  # 2 GB/s
    assert cpu["coordinator_call_us"] == pytest.approx(0.020 / 100 * 1e6)  # 200 us
    # files posting raw descriptors (merging) measured apart from those posting prepared lists
    raw = {**one, "by_op": {"StartRead": [10, 0.030, 0]}, "posts": 10, "post_cpu_seconds": 0.010}
    split = measured_cpu([result(one), result(raw)], [False, True])
    assert split["rank_dispatch_us"] == pytest.approx((0.014 - 0.006) / 20 * 1e6)  # 400 us
    assert split["rank_dispatch_unprepped_us"] == pytest.approx(0.020 / 10 * 1e6)  # 2 ms
    assert measured_cpu([result(one)], [False])["rank_dispatch_unprepped_us"] is None
    timing_only = {**one, "by_op": {"StartRead": [10, 0.010, 0]}}
    assert measured_cpu([result(timing_only)])["oracle_core_gbps"] is None
    with pytest.raises(ValidationError, match="no post calls"):
        measured_cpu([result({"by_op": {}, "posts": 0, "post_cpu_seconds": 0.0})])


def test_oracle_cost_separates_a_per_operation_cost_from_bytes() -> None:
    from hkvsim.validate import FileResult
    from hkvsim.validate_fit import oracle_cost

    def result(ops: int, nbytes: int, cpu: float) -> FileResult:
        half = [ops // 2, cpu / 2, nbytes // 2]
        return _with_rank_cpu({"by_op": {"OracleWrite": half, "Verify": half,
                                         "StartRead": [ops, 1.0, 0]},
                               "posts": ops, "post_cpu_seconds": 0.1})

    def cost(ops: int, per_op_bytes: int) -> FileResult:  # 1.2 ms per op + 10 GB/s
        return result(ops, ops * per_op_bytes, ops * (1.2e-3 + per_op_bytes / 10e9))

    files = [cost(10, 1_000_000), cost(10, 6_000_000), cost(20, 3_000_000)]
    assert oracle_cost(files) == (pytest.approx(10.0), pytest.approx(1200.0))
    # one size per operation: the two terms cannot be told apart -> bytes alone
    same = [cost(10, 2_000_000), cost(30, 2_000_000)]
    assert oracle_cost(same) == (pytest.approx(80e6 / 0.056 / 1e9, rel=1e-3), 0.0)
    # sizes within 10 % of each other: noise would decide the split -> bytes alone
    near = [cost(10, 2_000_000), result(30, 63_000_000, 0.0425)]
    assert oracle_cost(near) == (pytest.approx(83e6 / 0.0565 / 1e9, rel=1e-3), 0.0)
    # a fit that would make the per-operation cost negative -> bytes alone
    odd = [result(10, 10_000_000, 0.001), result(10, 60_000_000, 0.020)]
    assert oracle_cost(odd)[1] == 0.0
    assert oracle_cost([result(10, 0, 0.0)]) == (None, 0.0)  # timing-only runs


def test_oracle_per_operation_cost_holds_the_rank_in_verified_runs() -> None:
    from hkvsim.drivers.sim import SimDriver
    from hkvsim.results import result_json
    from hkvsim.scenario import load_scenarios
    from hkvsim.validate import steady_transfer_mean, with_profile

    scenario = load_scenarios(ROOT / "scenarios/fit/deepseek-pull-1to2-burst3-warmed.toml")[0]
    base = {**HOST, "host_copy_core_gbps": 5.0, "oracle_core_gbps": 1000.0}

    def ms(overrides: dict[str, Any], timing_only: bool = False) -> float:
        data = result_json(SimDriver(with_profile(scenario, CPU_BASE, overrides),
                                     timing_only=timing_only).run(), requests=True)
        return steady_transfer_mean(data) * 1e3

    per_op = {**base, "oracle_op_us": 3000.0}
    assert ms(per_op) > 1.5 * ms(base)  # 3 ms fills and checks hold the rank and its core
    assert ms(per_op, timing_only=True) == pytest.approx(ms(base, timing_only=True))


# ---- dispatch per operation and per post -----------------------------------------------------
def test_dispatch_split_separates_per_operation_from_per_post_cpu() -> None:
    from hkvsim.validate import FileResult
    from hkvsim.validate_fit import dispatch_split

    def result(ops: int, posts: int, per_op: float, per_post: float) -> FileResult:
        post_cpu = 0.1e-3 * posts  # CPU inside the post calls: not dispatch
        start = ops * per_op + posts * per_post + post_cpu
        return _with_rank_cpu({"by_op": {"StartRead": [ops, start, 0]}, "posts": posts,
                               "post_cpu_seconds": post_cpu})

    # one post per operation and two: 400 us per operation + 450 us per post
    files = [result(8, 8, 400e-6, 450e-6), result(8, 16, 400e-6, 450e-6),
             result(32, 32, 400e-6, 450e-6)]
    assert dispatch_split(files) == (pytest.approx(450.0), pytest.approx(400.0))
    # every file posts once per operation: the two cannot be told apart -> all per post
    once = [result(8, 8, 400e-6, 450e-6), result(32, 32, 400e-6, 450e-6)]
    assert dispatch_split(once) == (pytest.approx(850.0), 0.0)
    # a fit with a negative per-operation cost -> all per post
    odd = [result(8, 8, 0.0, 100e-6), result(8, 16, 0.0, 400e-6)]
    assert dispatch_split(odd)[1] == 0.0
    assert dispatch_split([]) == (None, 0.0)


def test_an_operation_pays_its_own_dispatch_once_before_its_first_post() -> None:
    env, fabric = _fabric({**HOST, "host_copy_cores": 4, "rank_dispatch_us": 100.0,
                           "rank_op_dispatch_us": 500.0,
                           "rank_op_dispatch_unprepped_us": 900.0})
    got: dict[str, Any] = {}

    def op(name: str, at: float, count: int, unprepped: bool) -> Any:
        yield env.timeout(at)
        events = [fabric.transfer(initiator="a", src="b", dst="a", nbytes=1000, descriptors=1,
                                  unprepped=unprepped) for _ in range(count)]
        for i, ev in enumerate(events):
            got[f"{name}{i}"] = yield ev

    env.process(op("x", 0.0, 2, False))  # one operation posting twice
    env.process(op("y", 0.05, 1, True))  # a later one, from raw descriptors
    env.run()
    x0, x1, y0 = got["x0"], got["x1"], got["y0"]
    assert x0.post_start == pytest.approx(600e-6)  # 500 per operation + 100 for the transfer
    assert x1.post_start - x0.wire_end == pytest.approx(100e-6)  # the second: its own only
    assert y0.post_start == pytest.approx(0.05 + 900e-6 + 100e-6)


# ---- the ranks' polling CPU --------------------------------------------------------------------
POLL = {**HOST, **PEER, "poll_cpu_us": 1000.0}  # each waiting rank demands 1/2 a core


def test_other_ranks_polling_stretches_work_only_when_the_busy_cores_lack_room() -> None:
    """Four ranks on two cores: a copy's rank leaves three pollers of 1/2 a core each; two
    copies at once share the 0.5 core left (floored at one core: stretched 2x); one copy
    alone fits in what the pollers leave and is not stretched."""
    nbytes = 10**7  # 10 ms at 1 GB/s per core
    plain_one = _fabric(HOST)
    env, fabric = plain_one
    ref = fabric.transfer(initiator="a", src="a", dst="b", nbytes=nbytes, descriptors=1)
    env.run()
    env, fabric = _fabric(POLL)
    alone = fabric.transfer(initiator="a", src="a", dst="b", nbytes=nbytes, descriptors=1)
    env.run()
    assert alone.value.wire_time == pytest.approx(ref.value.wire_time, rel=1e-12)
    env, fabric = _fabric(POLL)
    pair = [fabric.transfer(initiator=k, src=k, dst="d", nbytes=nbytes, descriptors=1)
            for k in "ab"]
    env.run()
    # both start at once and find both cores busy: 2 / max(2 - 1.5, 1) = 2
    assert [t.value.wire_time for t in pair] == pytest.approx([2 * ref.value.wire_time] * 2,
                                                              rel=1e-12)
    # with fewer pollers the stretch is the busy cores over the cores they leave
    env, fabric = _fabric({**POLL, "poll_cpu_us": 100.0}, names="abc")  # 2 x 1/11 of a core
    pair = [fabric.transfer(initiator=k, src=k, dst="c", nbytes=nbytes, descriptors=1)
            for k in "ab"]
    env.run()
    assert pair[1].value.wire_time == pytest.approx(
        ref.value.wire_time * 2 / (2 - 2 * 100 / 1100), rel=1e-12)


def test_polling_stretches_the_coordinators_and_the_oracles_work_too() -> None:
    env, fabric = _fabric(POLL)
    busy = fabric.cpu_work("a", 10e-3)  # holds one core, 10 ms
    coord = fabric.coordinator_work(10e-3)  # the second core, all four ranks polling: 2 / 1
    env.run()
    assert busy.processed and coord.processed
    assert env.now == pytest.approx(20e-3, rel=1e-12)
    env, fabric = _fabric(POLL)
    alone = fabric.coordinator_work(10e-3)
    env.run()
    assert alone.processed and env.now == pytest.approx(10e-3, rel=1e-12)


def test_polling_cpu_needs_the_poll_periods() -> None:
    from hkvsim.fabric import ProfileError

    with pytest.raises(ProfileError, match="'poll_cpu_us' without 'peer_poll_idle_us'"):
        load_profile(CPU, overrides={**HOST, "poll_cpu_us": 50.0})
    p = load_profile(CPU, overrides=POLL)
    assert p.poll_demand == pytest.approx(0.5)
    assert load_profile(CPU, overrides={**HOST, **PEER}).poll_demand == 0.0


def test_rank_loops_report_their_polls_and_calibration_takes_the_idle_ones() -> None:
    from hkvsim.validate_fit import measured_cpu

    a, b = RankCpu(), RankCpu()
    a.add_poll(False, 40e-6)
    a.add_poll(False, 60e-6)
    a.add_poll(True, 150e-6)
    b.add_poll(False, 50e-6)
    merged = merge_rank_cpu([a.to_wire(), b.to_wire()])
    assert merged["polls"]["idle"] == [3, pytest.approx(150e-6)]
    assert merged["polls"]["busy"] == [1, pytest.approx(150e-6)]
    older = {"by_op": {}, "posts": 0, "post_cpu_seconds": 0.0}  # a record without polls
    assert "polls" not in merge_rank_cpu([older])
    assert merge_rank_cpu([older, a.to_wire()])["polls"]["idle"][0] == 2
    with pytest.raises(ValueError, match="rank CPU record .*'polls'"):
        merge_rank_cpu([{**older, "polls": {"idle": [1, 0.1]}}])
    one = {**merged, "by_op": {"StartRead": [10, 0.010, 0]}, "posts": 10,
           "post_cpu_seconds": 0.005}
    cpu = measured_cpu([_with_rank_cpu(one)])
    assert cpu["poll_cpu_us"] == pytest.approx(50.0)
    assert cpu["poll_busy_cpu_us"] == pytest.approx(150.0)
    assert cpu["poll_iterations"] == (3, 1)
    assert measured_cpu([_with_rank_cpu(older | {"by_op": {"StartRead": [1, 0.01, 0]},
                                                 "posts": 1})])["poll_cpu_us"] == 0.0


# ---- busy cores slowing each other -----------------------------------------------------------
def test_busy_cores_slow_each_other_by_the_contention() -> None:
    """Two copies at once on the two cores each take 1 + c longer, one alone does not (work is
    priced by how many cores are busy when it starts); on top of the polling stretch, not
    instead of it; the coordinator's work too."""
    nbytes = 10**7  # 10 ms at 1 GB/s per core
    env, fabric = _fabric(HOST)
    ref = fabric.transfer(initiator="a", src="a", dst="b", nbytes=nbytes, descriptors=1)
    env.run()
    one = ref.value.wire_time
    env, fabric = _fabric({**HOST, "core_contention": 0.25})
    alone = fabric.transfer(initiator="a", src="a", dst="b", nbytes=nbytes, descriptors=1)
    env.run()
    assert alone.value.wire_time == pytest.approx(one, rel=1e-12)
    env, fabric = _fabric({**HOST, "core_contention": 0.25})
    pair = [fabric.transfer(initiator=k, src=k, dst="d", nbytes=nbytes, descriptors=1)
            for k in "ab"]
    env.run()
    assert [t.value.wire_time for t in pair] == pytest.approx([1.25 * one] * 2, rel=1e-12)
    # with the polling stretch (2x, as in the test above): both apply
    env, fabric = _fabric({**POLL, "core_contention": 0.25})
    pair = [fabric.transfer(initiator=k, src=k, dst="d", nbytes=nbytes, descriptors=1)
            for k in "ab"]
    env.run()
    assert [t.value.wire_time for t in pair] == pytest.approx([2 * 1.25 * one] * 2, rel=1e-12)
    # the coordinator's work beside a rank's is slowed too
    env, fabric = _fabric({**HOST, "core_contention": 0.5})
    busy = fabric.cpu_work("a", 10e-3)
    coord = fabric.coordinator_work(10e-3)
    env.run()
    assert busy.processed and coord.processed and env.now == pytest.approx(15e-3, rel=1e-12)


def test_core_contention_needs_the_host_model_and_is_positive() -> None:
    from hkvsim.fabric import ProfileError

    with pytest.raises(ProfileError, match="core_contention"):
        load_profile(CPU, overrides={"core_contention": 0.25})
    with pytest.raises(ProfileError, match="'core_contention' = -0.25: expected"):
        load_profile(CPU, overrides={**HOST, "core_contention": -0.25})
    assert load_profile(CPU, overrides={**HOST, "core_contention": 0.25}).core_contention == 0.25
    assert load_profile(CPU, overrides=HOST).core_contention == 0.0


def test_the_fit_searches_the_contention_and_writes_it_into_the_profile(tmp_path: Path) -> None:
    from hkvsim.validate_fit import GRID_CONTENTION, HostFit, host_block, replace_host_block

    assert GRID_CONTENTION[0] == 0.0 and len(GRID_CONTENTION) >= 3  # none is a candidate
    fit = HostFit(cores=2, core_gbps=4.7684, completion_notice_us=300.0,
                  coordinator_message_us=30.0, core_contention=0.25)
    assert fit.overrides()["core_contention"] == 0.25
    assert "core_contention" not in HostFit(2, 4.0, 300.0, 30.0).overrides()
    meta = {"when": "now", "fit_source": "scenarios/fit/", "held_out_source": "v", "fit_files": 9,
            "repeats": 5, "load_min": 0.1, "load_max": 1.0, "forced": False,
            "held_out_median": "12 %", "held_out_worst": "21 %"}
    text = replace_host_block(CPU_BASE.read_text(), host_block(fit, meta))
    assert "\ncore_contention = 0.25\n" in text
    (tmp_path / "p.toml").write_text(text)
    assert load_profile(str(tmp_path / "p.toml")).core_contention == 0.25


def test_operations_that_hold_the_loop_while_a_transfer_is_in_progress_are_counted() -> None:
    """On the first H200 run, oracle steps of 0.9-3 s ran while cuda_ipc transfers were in
    flight; NIXL times a transfer up to the poll that sees it done, so those transfers looked
    seconds long. The rank counts such operations and the run warns about the long ones."""
    from hkvsim.pd.cpu import BLOCKED_WARN_SECONDS, blocked_warnings

    a, b = RankCpu(), RankCpu()
    a.add_blocked("Verify", 0.9)
    a.add_blocked("Verify", 0.1)
    b.add_blocked("Verify", 0.4)
    b.add_blocked("StartRead", 0.001)
    merged = merge_rank_cpu([a.to_wire(), b.to_wire()])
    assert merged["blocked"] == {"StartRead": [1, pytest.approx(0.001), pytest.approx(0.001)],
                                 "Verify": [3, pytest.approx(1.4), pytest.approx(0.9)]}
    assert blocked_warnings(merged) == [
        "ranks ran Verify 3 time(s) while a NIXL transfer of theirs was in progress, for up to "
        "0.900 s (1.400 s in all), without polling NIXL: a transfer that completed meanwhile is "
        "timed (wire) up to that much too long"]
    just_under = RankCpu()
    just_under.add_blocked("Verify", BLOCKED_WARN_SECONDS * 0.99)
    assert blocked_warnings(merge_rank_cpu([just_under.to_wire()])) == []
    at = RankCpu()
    at.add_blocked("Verify", BLOCKED_WARN_SECONDS)
    assert len(blocked_warnings(merge_rank_cpu([at.to_wire()]))) == 1
    older = {"by_op": {}, "posts": 0, "post_cpu_seconds": 0.0}  # stored records have none
    assert "blocked" not in merge_rank_cpu([older]) and blocked_warnings(older) == []
    assert merge_rank_cpu([older, a.to_wire()])["blocked"]["Verify"][0] == 2
    with pytest.raises(ValueError, match="rank CPU record .*'blocked'"):
        merge_rank_cpu([{**older, "blocked": {"Verify": [1, 0.1]}}])


def test_a_rank_counts_only_operations_run_while_a_transfer_is_in_progress() -> None:
    """The rank loop asks its transport how many transfers are in progress before each
    operation: with UCX cma the copy ends inside the post (none), on a GPU it does not."""
    from types import SimpleNamespace

    from hkvsim.backends.rank import RankProcess
    from hkvsim.pd.ops import op_to_wire

    sent = []
    proc = RankProcess.__new__(RankProcess)
    proc.chan = SimpleNamespace(send=sent.append)
    proc.cpu = RankCpu()
    proc.epoch, proc.long_ops = 0.0, LongOps()
    proc.executor = SimpleNamespace(execute=lambda op: [], oracle=None,
                                    worker=SimpleNamespace(layout=None))
    in_progress = [0]
    proc.transport = SimpleNamespace(transfers_in_progress=lambda: in_progress[0])
    from hkvsim.pd.ops import SendNotif

    message = {**op_to_wire(SendNotif(agents=("prefill0.0",), message=b"x")), "seq": 1}
    proc._command(message)
    assert proc.cpu.blocked == {} and sent[-1]["ok"], sent
    in_progress[0] = 2
    proc._command({**message, "seq": 2})
    assert list(proc.cpu.blocked) == ["SendNotif"] and proc.cpu.blocked["SendNotif"][0] == 1


def test_a_rank_keeps_its_long_operations_on_the_runs_clock() -> None:
    """What remote_hold_warnings compares with its peers' transfers: an operation that held the
    loop for 20 ms or more, with its start and end on the clock NIXL telemetry uses (wall time
    since the run's epoch); shorter ones are not kept, and the stats reply carries them."""
    import time
    from types import SimpleNamespace

    from hkvsim.backends.rank import RankProcess
    from hkvsim.pd.ops import SendNotif, op_to_wire

    sent = []
    proc = RankProcess.__new__(RankProcess)
    proc.chan = SimpleNamespace(send=sent.append)
    proc.cpu = RankCpu()
    proc.engine, proc.rank = "prefill0", 1
    proc.epoch, proc.long_ops = time.time() - 100.0, LongOps()
    pause = [0.03]
    proc.executor = SimpleNamespace(execute=lambda op: time.sleep(pause[0]) or [], oracle=None,
                                    worker=SimpleNamespace(layout=None, in_flight=lambda: 0,
                                                           pending_releases=lambda: 0,
                                                           notification_failures=0))
    proc.transport = SimpleNamespace(transfers_in_progress=lambda: 0, open_handles=lambda: 0)
    message = {**op_to_wire(SendNotif(agents=("decode0.0",), message=b"x")), "seq": 1}
    proc._command(message)
    pause[0] = 0.0
    proc._command({**message, "seq": 2})
    (op,) = proc.long_ops.ops
    assert op[0] == "SendNotif" and 100.0 <= op[1] < 101.0 and op[2] - op[1] >= 0.03
    stats = proc._cmd_stats({"op": "stats", "seq": 3})
    assert stats["agent"] == "prefill0.1" and stats["long_ops"] == {"ops": [op], "dropped": 0}


@pytest.mark.parametrize("notif, waits", [(b"", False), (b"req-0:1", True)])
def test_only_a_transfer_that_carries_a_notification_waits_for_its_remote(
        notif: bytes, waits: bool) -> None:
    """Measured on UCX cma and on cuda_ipc with NIXL's progress thread off
    (hkvsim.backends.progress_probe, reports/gpu/README.md): a transfer with a notification
    completes only once its remote calls into NIXL; one without does not wait."""
    import numpy as np
    from sim_agents import sim_agent_pair

    env, a, b = sim_agent_pair()
    a.world.peer_progress = lambda agent, after: after + 5e-3  # the remote polls 5 ms later
    mem_a, mem_b = (t.allocate(1 << 20, mem_type="DRAM") for t in (a, b))
    a.register_memory(mem_a)
    b.register_memory(mem_b)
    remote = a.add_remote_agent(b.get_agent_metadata())
    local = np.array([[mem_a.base_addr, 4096, 0]], dtype=np.uint64)
    far = np.array([[mem_b.base_addr, 4096, 0]], dtype=np.uint64)
    handle = a.make_xfer("READ", local, remote, far, notif)
    a.transfer(handle)
    env.run()
    assert a.check_xfer_state(handle) == "DONE"
    t = a.get_xfer_telemetry(handle)
    assert (t.completed - t.submitted >= 5e-3) is waits
