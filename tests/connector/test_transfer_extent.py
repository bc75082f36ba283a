"""``[connector] transfer_extent``: what hkvsim's core moves per request.

"allocated" (the default, the reference semantics) moves every state slot of a cache group over
every shared tensor, the slots no layer of the group holds included, and whole logical blocks;
"needed" (what vLLM 0.34.0 moves) moves state only over the tensors holding a layer of the
slot's group and, in a pull between engines whose blocks differ, no kernel block past the
request's last computed token. The expected byte counts here come from the model's own figures
(layers, state bytes per request, page bytes), not from the connector's descriptor lists, and
every run is checked byte for byte by the oracle: a "needed" run that dropped bytes decode
needs fails as corruption.
"""

from __future__ import annotations

import math

import numpy as np

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.connector.worker import ConnectorSettings
from hkvsim.geometry import preset
from hkvsim.geometry.layout import has_uneven_group
from hkvsim.pd.deployment import build_deployment
from hkvsim.scenario import ScenarioError, parse_scenarios

pytestmark = pytest.mark.timeout(180)

TEXT = """
[scenario]
name = "transfer extent"
seed = 5
[model]
preset = "{preset}"
[prefill]
tp = {p}
[decode]
tp = {d}
[connector]
mode = "{mode}"
{extent}
[workload]
requests = 4
prompt_tokens = [641, 300, 1916, 65]
"""


def _run(preset_name: str, p: int, d: int, extent: str | None, mode: str = "pull"):
    line = "" if extent is None else f'transfer_extent = "{extent}"'
    (s,) = parse_scenarios(TEXT.format(preset=preset_name, p=p, d=d, mode=mode, extent=line),
                           source="transfer extent test")
    result = run_scenario(s)
    assert result.outcome == "ok" and result.verified and result.mismatched_bytes == 0, (
        preset_name, p, d, extent, result.outcome)
    return s, result


def _unheld_slots(model) -> int:
    """(shared tensors x state groups) - state layers: the slots of a state group on tensors
    that hold no layer of it (from the model's layer counts: tensors = the largest group)."""
    attention, state = len(model.attention_layers), len(model.state_layers)
    tensors = attention  # one attention group: every tensor holds one attention layer
    groups = math.ceil(state / tensors)
    return tensors * groups - state


def test_the_default_is_the_reference_extent() -> None:
    assert ConnectorSettings().transfer_extent == "allocated"
    (s,) = parse_scenarios(TEXT.format(preset="tiny-llama", p=1, d=1, mode="pull", extent=""),
                           source="t")
    assert s.connector.transfer_extent == "allocated"
    deployment = build_deployment(s)
    assert deployment.settings["prefill"].transfer_extent == "allocated"


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_needed_moves_no_state_over_tensors_no_layer_of_the_group_holds(mode: str,
                                                                        tp: int) -> None:
    # tiny-kimi-linear: 3 MLA layers, 7 KDA layers in groups of 3 -> 3 tensors, the last KDA
    # group holds one layer, so 2 of its 3 slots hold nothing; same TP: same block geometry
    model = preset("tiny-kimi-linear")
    assert has_uneven_group(model) and _unheld_slots(model) == 2
    per_layer = model.state_bytes_per_request(1) // len(model.state_layers)
    s, allocated = _run("tiny-kimi-linear", tp, tp, None, mode)
    _, needed = _run("tiny-kimi-linear", tp, tp, "needed", mode)
    for a, n in zip(allocated.records, needed.records):
        # every rank's shard of the two unheld slots, summed over the ranks: 2 layers' state
        assert a.nbytes - n.nbytes == 2 * per_layer, (a.nbytes, n.nbytes)
        assert a.descriptors > n.descriptors and a.transfers == n.transfers


@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-deepseek", "tiny-qwen3-next"])
def test_needed_is_allocated_where_every_group_fills_every_tensor(preset_name: str) -> None:
    # no uneven cache group and the same block geometry on both sides: nothing to leave out,
    # so the same descriptors, bytes and simulated times
    assert not has_uneven_group(preset(preset_name))
    _, allocated = _run(preset_name, 2, 2, None)
    _, needed = _run(preset_name, 2, 2, "needed")
    assert [(r.descriptors, r.nbytes, r.times) for r in allocated.records] == [
        (r.descriptors, r.nbytes, r.times) for r in needed.records]


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
def test_needed_pull_across_block_geometries_stops_at_the_last_computed_token(p: int,
                                                                              d: int) -> None:
    # KimiLinear's logical block follows its state page, which shrinks with TP: these pairs
    # differ in kernel blocks per logical block. "needed" moves, per decode rank, the MLA
    # kernel blocks up to the one holding token N-1 (prefill computes N-1 for a model with
    # state), and the state of the 7 KDA layers (sharded over the decode ranks): exactly
    s, result = _run("tiny-kimi-linear", p, d, "needed")
    deployment = build_deployment(s)
    decode = deployment.engines["decode"][0].layout
    prefill = deployment.engines["prefill"][0].layout
    assert decode.physical_blocks_per_logical != prefill.physical_blocks_per_logical
    model = decode.model
    kernel = decode.kernel_block_size
    for tokens, record in zip(s.workload.prompt_tokens, result.records):
        blocks = -(-(tokens - 1) // kernel)
        attention = d * len(model.attention_layers) * blocks * decode.attention_page_bytes
        assert record.nbytes == attention + model.state_bytes_per_request(1), (tokens, p, d)
    _, allocated = _run("tiny-kimi-linear", p, d, None)
    assert sum(r.nbytes for r in allocated.records) > sum(r.nbytes for r in result.records)


def test_needed_keeps_whole_kernel_blocks_of_a_logical_block_at_the_same_geometry() -> None:
    # same TP: the same logical block on both sides; "needed" pairs them as "allocated" does
    # (what vLLM 0.34.0 does there too), so only the unheld state slots differ
    model = preset("tiny-kimi-linear")
    per_layer = model.state_bytes_per_request(1) // len(model.state_layers)
    s, allocated = _run("tiny-kimi-linear", 2, 2, None)
    _, needed = _run("tiny-kimi-linear", 2, 2, "needed")
    decode = build_deployment(s).engines["decode"][0].layout
    assert decode.physical_blocks_per_logical > 1
    for tokens, a, n in zip(s.workload.prompt_tokens, allocated.records, needed.records):
        assert a.nbytes - n.nbytes == 2 * per_layer
        exact = 2 * 3 * -(-(tokens - 1) // decode.kernel_block_size) * (
            decode.attention_page_bytes) + model.state_bytes_per_request(1)
        assert n.nbytes >= exact  # whole logical blocks: at least the exact count


def test_an_unknown_transfer_extent_is_refused_naming_the_choices() -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenarios(TEXT.format(preset="tiny-llama", p=1, d=1, mode="pull",
                                    extent='transfer_extent = "exact"'), source="t")
    text = str(err.value)
    assert "transfer_extent" in text and "'allocated'" in text and "'needed'" in text
    with pytest.raises(ValueError, match="allowed: allocated, needed"):
        from hkvsim.connector.worker import ConnectorWorker
        from hkvsim.geometry import build_layout

        model = preset("tiny-llama")
        ConnectorWorker(engine_id="e", role="decode", tp_rank=0,
                        layout=build_layout(model, tp=1, block_size=16, num_blocks=8),
                        transport=None,  # type: ignore[arg-type]
                        settings=ConnectorSettings(transfer_extent="exact"))


@pytest.mark.parametrize("version,expected", [("0.34.0", "needed"), ("0.33.0", "allocated"),
                                              ("0.27.0", "allocated"), ("0.26.0", "allocated")])
def test_beside_a_vllm_release_the_core_moves_what_that_release_moves(version: str,
                                                                      expected: str) -> None:
    # hkvsim diff / fuzz: the core runs with the release's transfer extent, unless the file
    # chose one itself (then the file's choice stands, whatever the release)
    from hkvsim.implementations.diff import core_extent, with_implementation

    (s,) = parse_scenarios(TEXT.format(preset="tiny-kimi-linear", p=1, d=2, mode="pull",
                                       extent=""), source="t")
    assert core_extent(s, version) == expected and core_extent(s, None) == "allocated"
    core = with_implementation(s, "hkvsim", like_vllm=version)
    assert core.connector.transfer_extent == expected
    assert core.connector.implementation == "hkvsim"
    vllm = with_implementation(s, "vllm", like_vllm=version)
    assert vllm.connector.implementation == "vllm"
    assert with_implementation(s, "hkvsim").connector.transfer_extent == "allocated"
    for chosen in ("allocated", "needed"):
        (fixed,) = parse_scenarios(TEXT.format(
            preset="tiny-kimi-linear", p=1, d=2, mode="pull",
            extent=f'transfer_extent = "{chosen}"'), source="t")
        assert core_extent(fixed, version) == chosen
        assert with_implementation(fixed, "hkvsim", like_vllm=version
                                   ).connector.transfer_extent == chosen


def test_held_subregions_name_the_first_ids_and_bytes_of_the_sub_regions_asked_for() -> None:
    # kimi-linear-48b TP8: 7 tensors x 4 state sub-regions (3 conv parts of 3,072 B and a
    # 262,144 B recurrent state, docs/semantics.md §2.3); ask for tensor 1 and tensor 5 (not a
    # prefix of the list), and for tensor 6's recurrent part alone
    from hkvsim.connector.descriptors import local_descriptors

    from ._helpers import layout, meta, state_regions

    lay = layout("kimi-linear-48b", 8, block_size=64, num_blocks=100)
    dl = local_descriptors(meta(lay), state_regions(lay))
    assert (dl.num_attention_regions, dl.attention_blocks, dl.num_state_subregions,
            dl.state_blocks) == (7, 400, 28, 100)
    positions = (4, 5, 6, 7, 20, 21, 22, 23)
    starts, slot_bytes = dl.held_subregions(positions)
    # first ids: R_fa * N_fa + q * N_log for each sub-region q (docs/semantics.md §3.4)
    assert starts.tolist() == [2800 + q * 100 for q in positions]
    assert slot_bytes == 2 * (3 * 3_072 + 262_144)
    assert dl.held_subregions((27,)) == (dl.held_subregions((27,))[0], 262_144)
    assert dl.held_subregions(positions)[0] is starts  # made once: the same array
    with pytest.raises(ValueError, match="outside the list's 28"):
        dl.held_subregions((28,))


def test_a_partial_group_moves_its_slots_over_its_sub_regions_only_after_the_rest() -> None:
    # the ids one transfer names: every attention region's blocks, every state sub-region's
    # full-group slots, then the partial group's slots over its sub-regions only (positions
    # that are not a prefix of the list, as no preset has them, to pin the indexing)
    from hkvsim.connector.descriptors import local_descriptors
    from hkvsim.connector.worker import ConnectorWorker

    from ._helpers import layout, meta, state_regions

    lay = layout("tiny-kimi-linear", 1, block_size=64, num_blocks=40)
    dl = local_descriptors(meta(lay), state_regions(lay))
    remote = local_descriptors(meta(lay, engine="remote"), state_regions(lay))
    worker = ConnectorWorker.__new__(ConnectorWorker)
    worker._outer_ids = False
    worker.settings = ConnectorSettings(transfer_extent="needed")
    blocks = (np.array([3, 4], np.int64), np.array([7, 8], np.int64))
    slots = (np.array([10, 11], np.int64), np.array([20, 21], np.int64))
    sub = dl.num_state_subregions // 3  # sub-regions per tensor
    positions = tuple(range(2 * sub, 3 * sub))  # the third tensor only
    partial = [(positions, np.array([12], np.int64), np.array([22], np.int64))]
    local_ids, remote_ids, nbytes = worker._transfer_ids(dl, remote, blocks, slots,
                                                         (False, False), partial)
    q = np.arange(dl.num_state_subregions)
    want_local = np.concatenate([dl.attention_ids(blocks[0]), dl.state_ids(slots[0]),
                                 dl.state_ids(np.array([12]))[q >= 2 * sub]])
    want_remote = np.concatenate([remote.attention_ids(blocks[1]), remote.state_ids(slots[1]),
                                  remote.state_ids(np.array([22]))[q >= 2 * sub]])
    assert np.asarray(local_ids).tolist() == want_local.tolist()
    assert np.asarray(remote_ids).tolist() == want_remote.tolist()
    rows = dl.affine.materialise()
    assert nbytes == int(rows[want_local, 1].sum())  # the bytes those descriptors name
