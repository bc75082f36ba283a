"""TP mapping from the reader's (local) view (docs/semantics.md §1, §4.1, §5.1-5.2).

Pure functions; ``local`` is decode in pull and prefill in push.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..geometry.specs import ModelSpec

__all__ = ["TPError", "tp_ratio", "handshake_targets", "SourcePlan", "source_plan"]


class TPError(ValueError):
    """A TP pair that cannot be mapped (rule V1)."""


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """local/remote when local >= remote, else -remote/local; the ratio must be exact (V1)."""
    big, small = max(local_tp, remote_tp), min(local_tp, remote_tp)
    if big % small:
        raise TPError(
            f"V1: TP ratio is not integral: local TP {local_tp}, remote TP {remote_tp} "
            f"(one must divide the other)"
        )
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


def handshake_targets(local_tp: int, remote_tp: int, tp_rank: int) -> tuple[int, ...]:
    """Remote ranks a local rank handshakes with: [rank // r] or [rank*|r| + i, i < |r|]."""
    r = tp_ratio(local_tp, remote_tp)
    if r > 0:
        return (tp_rank // r,)
    return tuple(tp_rank * -r + i for i in range(-r))


def _first_head(num_kv_heads: int, tp: int, rank: int) -> int:
    if tp > num_kv_heads:
        return rank * num_kv_heads // tp
    return rank * (num_kv_heads // tp)


@dataclass(frozen=True, kw_only=True)
class SourcePlan:
    """Which remote ranks one local rank reads from (or writes to), and how it slices."""

    tp_ratio: int
    attention_sources: tuple[int, ...]
    state_sources: tuple[int, ...]
    all_sources: tuple[int, ...]
    rank_offset_factor: int
    use_split_handles: bool

    def attention_slot(self, remote_rank: int) -> int:
        """rank_to_attention_slot: the remote rank's position among the attention sources."""
        return self.attention_sources.index(remote_rank)

    def state_chunk(self, remote_rank: int) -> int:
        """p_idx for state: the remote rank's position among the state sources."""
        return self.state_sources.index(remote_rank)

    @property
    def fa_splits(self) -> int:
        return len(self.attention_sources)

    @property
    def ssm_splits(self) -> int:
        return len(self.state_sources)


def source_plan(model: ModelSpec, *, local_tp: int, remote_tp: int, tp_rank: int) -> SourcePlan:
    """docs/semantics.md §5.1 source ranks, slots and offset factor; §5.2 split-handle rule."""
    r = tp_ratio(local_tp, remote_tp)
    attn = model.attention
    if attn.is_mla or local_tp >= remote_tp:
        attention_sources: tuple[int, ...] = (tp_rank * remote_tp // local_tp,)
    else:
        k = attn.num_kv_heads  # type: ignore[union-attr]
        seen: dict[int, int] = {}
        for rank in range(tp_rank * -r, (tp_rank + 1) * -r):
            seen.setdefault(_first_head(k, remote_tp, rank), rank)
        attention_sources = tuple(seen.values())
    if model.is_hybrid and local_tp < remote_tp:
        state_sources = tuple(range(tp_rank * -r, (tp_rank + 1) * -r))
    elif model.is_hybrid:
        state_sources = attention_sources
    else:
        state_sources = ()
    all_sources = tuple(sorted(set(attention_sources) | set(state_sources)))
    if attn.is_mla or local_tp <= remote_tp:
        offset_factor = 0
    elif local_tp > attn.num_kv_heads:  # type: ignore[union-attr]
        k = attn.num_kv_heads  # type: ignore[union-attr]
        offset_factor = _first_head(k, local_tp, tp_rank) - _first_head(
            k, remote_tp, attention_sources[0])
    else:
        offset_factor = tp_rank % (local_tp // remote_tp)
    pure_mla = attn.is_mla and not model.is_hybrid
    use_split = r < 0 and (not pure_mla or len(all_sources) > 1)
    return SourcePlan(tp_ratio=r, attention_sources=attention_sources,
                      state_sources=state_sources, all_sources=all_sources,
                      rank_offset_factor=offset_factor, use_split_handles=use_split)
