"""docs/semantics.md §6 block-id handling and §7 pairing, with the reference vectors written out."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.connector.blocks import (
    PairingError,
    expand_logical,
    pair_attention,
    pair_state_slots,
    to_sub_blocks,
)

from ._helpers import layout


def _l(a) -> list[int]:
    return np.asarray(a).tolist()


# ---- §6 logical -> kernel -------------------------------------------------------------------


def test_expand_with_remote_ppl_reference_vector():
    # §6 (Qwen3.5-0.8B, kernel 64, ppl 6 at TP4, 10 at TP2): with remote ppl 10,
    # attention [0] -> [0..9] and state [10] -> [10]. Using ppl 6 gives [0..5].
    assert _l(expand_logical(np.array([0]), 10)) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert _l(expand_logical(np.array([0]), 6)) == [0, 1, 2, 3, 4, 5]
    # state ids pass through unchanged
    d, p = pair_state_slots(np.array([10]), np.array([10]))
    assert (_l(d), _l(p)) == ([10], [10])


def test_expand_keeps_order_and_whole_blocks():
    assert _l(expand_logical(np.array([3, 1]), 3)) == [9, 10, 11, 3, 4, 5]
    # second vector of §6: ppl 34 vs 66
    assert _l(expand_logical(np.array([1]), 34)) == list(range(34, 68))
    assert _l(expand_logical(np.array([1]), 66)) == list(range(66, 132))


def test_bsr_sub_blocks_clipped_to_remote_length():
    # §6 example: bsr 4; P sends 10 blocks; D's [a, b, c] = 12 sub-blocks, clipped to 10;
    # c's last 2 sub-blocks are (later) zeroed.
    a, b, c = 7, 2, 5
    subs = to_sub_blocks(np.array([a, b, c]), 4)
    assert _l(subs) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]
    pairing = pair_attention(decode_ids=subs, prefill_ids=np.arange(10), decode_hit_units=0,
                             heterogeneous_ppl=True, ppl_decode=4, ppl_prefill=1)
    assert _l(pairing.local) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert _l(pairing.remote) == list(range(10))
    # the untransferred tail: c's last two sub-blocks
    assert _l(subs[pairing.local.size:]) == [22, 23]


# ---- §7 pairing -----------------------------------------------------------------------------


def test_front_trim_640_tokens():
    # §7: 640 tokens at kernel 64 give P (ppl 10) 10 blocks and D (ppl 6) 12; both trimmed to 10.
    p = expand_logical(np.array([0]), 10)
    d = expand_logical(np.array([0, 1]), 6)
    assert (p.size, d.size) == (10, 12)
    pairing = pair_attention(decode_ids=d, prefill_ids=p, decode_hit_units=0,
                             heterogeneous_ppl=True, ppl_decode=6, ppl_prefill=10)
    assert (pairing.local.size, pairing.remote.size) == (10, 10)
    assert _l(pairing.local) == list(range(10)) and _l(pairing.remote) == list(range(10))


def test_prefix_caching_reference_heterogeneous_ppl():
    # §7 reference: P ppl 10, D ppl 6; D hits its first logical block (kernel 0..5) and lists
    # [6..11]. Correct: remote [6..9] -> local [6..9]. Front-trim: remote [0..5] -> local [6..11].
    p = np.arange(10)
    d = np.arange(6, 12)
    # hkvsim refuses the heterogeneous-ppl hit (V4 at handshake; PairingError per request)
    with pytest.raises(PairingError, match="heterogeneous"):
        pair_attention(decode_ids=d, prefill_ids=p, decode_hit_units=6, heterogeneous_ppl=True,
                       ppl_decode=6, ppl_prefill=10)
    # the bug replay (front-trim with prefix caching) pairs P's prefix with D's suffix
    bug = pair_attention(decode_ids=d, prefill_ids=p, decode_hit_units=6, heterogeneous_ppl=True,
                         ppl_decode=6, ppl_prefill=10, front_trim_with_prefix=True)
    assert _l(bug.remote) == [0, 1, 2, 3, 4, 5]
    assert _l(bug.local) == [6, 7, 8, 9, 10, 11]
    # token-aligned pairing from the hit offset gives the correct vector
    good = pair_attention(decode_ids=d, prefill_ids=p, decode_hit_units=6,
                          heterogeneous_ppl=False, ppl_decode=6, ppl_prefill=10)
    assert _l(good.remote) == [6, 7, 8, 9]
    assert _l(good.local) == [6, 7, 8, 9]


def test_end_trim_with_equal_ppl():
    # §7 non-hybrid / equal ppl: keep the last len(D) of P's ids.
    p = np.arange(8)
    d = np.array([40, 41, 42])  # D holds 5 blocks from its cache
    pairing = pair_attention(decode_ids=d, prefill_ids=p, decode_hit_units=5,
                             heterogeneous_ppl=False, ppl_decode=1, ppl_prefill=1)
    assert _l(pairing.remote) == [5, 6, 7]
    assert _l(pairing.local) == [40, 41, 42]
    # a full hit: nothing to pair (notification only)
    full = pair_attention(decode_ids=np.array([], dtype=np.int64), prefill_ids=p,
                          decode_hit_units=8, heterogeneous_ppl=False, ppl_decode=1,
                          ppl_prefill=1)
    assert full.local.size == full.remote.size == 0


def test_ppl_difference_bound():
    # §7: assert |len_D - len_P| <= ppl_D + ppl_P
    ok = pair_attention(decode_ids=np.arange(26), prefill_ids=np.arange(10), decode_hit_units=0,
                        heterogeneous_ppl=True, ppl_decode=6, ppl_prefill=10)
    assert ok.local.size == 10  # difference 16 = 6 + 10 is allowed
    with pytest.raises(PairingError, match="27") as exc:
        pair_attention(decode_ids=np.arange(27), prefill_ids=np.arange(10), decode_hit_units=0,
                       heterogeneous_ppl=True, ppl_decode=6, ppl_prefill=10)
    assert "16" in str(exc.value)


# §7 KimiLinear 8,192-token prompt (P holds 8,191 tokens):
# | Pair | P kernel ids | D kernel ids | Paired |
KIMI_PAIRING = [
    (1, 1, 5, 150, 150, 150),
    (1, 4, 5, 150, 128, 128),  # 22 <= 38
    (2, 1, 9, 135, 150, 135),  # 15 <= 45
]


@pytest.mark.parametrize("p_tp,d_tp,p_logical,p_kernel,d_kernel,paired", KIMI_PAIRING)
def test_kimi_linear_8192_token_pairing(p_tp, d_tp, p_logical, p_kernel, d_kernel, paired):
    p_lay = layout("kimi-linear-48b", p_tp, num_blocks=16)
    d_lay = layout("kimi-linear-48b", d_tp, num_blocks=16)
    assert p_lay.blocks_for_tokens(8_191) == p_logical
    ppl_p, ppl_d = p_lay.physical_blocks_per_logical, d_lay.physical_blocks_per_logical
    p_ids = expand_logical(np.arange(p_lay.blocks_for_tokens(8_191)), ppl_p)
    d_ids = expand_logical(np.arange(d_lay.blocks_for_tokens(8_191)), ppl_d)
    assert (p_ids.size, d_ids.size) == (p_kernel, d_kernel)
    pairing = pair_attention(decode_ids=d_ids, prefill_ids=p_ids, decode_hit_units=0,
                             heterogeneous_ppl=ppl_p != ppl_d, ppl_decode=ppl_d,
                             ppl_prefill=ppl_p)
    assert pairing.local.size == pairing.remote.size == paired


def test_state_slot_pairing_rules():
    # §7 hybrid state groups: pair by position.
    # P has more slots (null placeholders): take P's tail
    d, p = pair_state_slots(np.array([9]), np.array([3, 4, 5]))
    assert (_l(d), _l(p)) == ([9], [5])
    # D has exactly one more (slot for the recomputed token's state): drop it
    d, p = pair_state_slots(np.array([7, 8]), np.array([3]))
    assert (_l(d), _l(p)) == ([7], [3])
    # equal
    d, p = pair_state_slots(np.array([7]), np.array([3]))
    assert (_l(d), _l(p)) == ([7], [3])
    # anything else
    with pytest.raises(PairingError, match="unpairable SSM state slots"):
        pair_state_slots(np.array([7, 8, 9]), np.array([3]))
    with pytest.raises(PairingError, match="unpairable SSM state slots"):
        pair_state_slots(np.array([7, 8]), np.array([], dtype=np.int64))
