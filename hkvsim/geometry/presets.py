"""Named model presets: the four reference models and small ``tiny-*`` twins.

Real presets use the public configs' values (docs/semantics.md §2.3-2.4; the HF fixtures under
``tests/fixtures/hf`` hold the same numbers and a test checks both agree).

Tiny twins keep every structural feature of their big model while staying small enough for the
full heterogeneous-TP matrix in CI:

* irregular attention/state interleave and an uneven last HMA group (tiny-kimi-linear: MLA at
  1-based layers 3, 6, 10; 7 KDA layers -> groups of 3, 3, 1);
* equal Q/K/V conv sub-projections for KDA, unequal ones for GDN;
* TP 1, 2, 4 and 8 accepted (state heads and conv columns divisible by 8);
* every per-rank slice is a multiple of 8 bytes (the oracle writes 64-bit provenance words);
* physical_blocks_per_logical changes with TP because the state page spans several attention
  kernel pages at TP 1 (tiny-kimi-linear: ppl 10 / 5 / 3 / 2 at TP 1 / 2 / 4 / 8).
"""

from __future__ import annotations

from collections.abc import Callable

from .specs import (
    GeometryError,
    GQAAttentionSpec,
    MLAAttentionSpec,
    ModelSpec,
    gdn_state,
    kda_state,
)

__all__ = ["PRESETS", "preset", "preset_names"]


def _every(n: int, num_layers: int) -> tuple[int, ...]:
    """0-based indices of 1-based layers n, 2n, 3n, ... up to num_layers."""
    return tuple(range(n - 1, num_layers, n))


def kimi_linear_48b() -> ModelSpec:
    # Kimi-Linear-48B-A3B: 27 layers, MLA at 1-based 4, 8, ..., 24 and 27; KDA elsewhere.
    return ModelSpec(
        name="kimi-linear-48b",
        architecture="KimiLinearForCausalLM",
        num_layers=27,
        hidden_size=2304,
        attention=MLAAttentionSpec(kv_lora_rank=512, rope_dim=64, backend="flashmla"),
        attention_layers=_every(4, 24) + (26,),
        state=kda_state(num_heads=32, head_dim=128, conv_kernel=4),
    )


def qwen3_next_80b() -> ModelSpec:
    # Qwen3-Next-80B-A3B: full attention every 4th layer (GQA, 2 KV heads x 256), GDN elsewhere.
    return ModelSpec(
        name="qwen3-next-80b",
        architecture="Qwen3NextForCausalLM",
        num_layers=48,
        hidden_size=2048,
        attention=GQAAttentionSpec(num_kv_heads=2, head_dim=256, backend="flash-attn"),
        attention_layers=_every(4, 48),
        state=gdn_state(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128,
                        conv_kernel=4),
    )


def deepseek_v3() -> ModelSpec:
    return ModelSpec(
        name="deepseek-v3",
        architecture="DeepseekV3ForCausalLM",
        num_layers=61,
        hidden_size=7168,
        attention=MLAAttentionSpec(kv_lora_rank=512, rope_dim=64, backend="flashmla"),
        attention_layers=tuple(range(61)),
    )


def llama_31_8b() -> ModelSpec:
    return ModelSpec(
        name="llama-3.1-8b",
        architecture="LlamaForCausalLM",
        num_layers=32,
        hidden_size=4096,
        attention=GQAAttentionSpec(num_kv_heads=8, head_dim=128, backend="flash-attn"),
        attention_layers=tuple(range(32)),
    )


def tiny_kimi_linear() -> ModelSpec:
    # 10 layers: MLA at 1-based 3, 6, 10 (irregular tail like Kimi's 24 -> 27), 7 KDA layers ->
    # HMA groups 3 / 3 / 3 / 1 (one MLA group, three KDA groups, the last uneven).
    # MLA 56 + 8 latent (128 B/token, kernel page 8,192 B); KDA 16 heads x 32, conv 4:
    # conv 3 x 512 cols x 3 rows x 2 B = 9,216 B, recurrent 16 x 32 x 32 x 4 B = 65,536 B.
    return ModelSpec(
        name="tiny-kimi-linear",
        architecture="KimiLinearForCausalLM",
        num_layers=10,
        hidden_size=256,
        attention=MLAAttentionSpec(kv_lora_rank=56, rope_dim=8, backend="flashmla"),
        attention_layers=(2, 5, 9),
        state=kda_state(num_heads=16, head_dim=32, conv_kernel=4),
    )


def tiny_qwen3_next() -> ModelSpec:
    # 12 layers, attention every 4th (GQA 2 KV heads x 64: replicated past TP 2, like the real
    # model), GDN Hk 4 / Hv 8 x 32: conv Q|K|V = 128 | 128 | 256 columns (unequal).
    return ModelSpec(
        name="tiny-qwen3-next",
        architecture="Qwen3NextForCausalLM",
        num_layers=12,
        hidden_size=256,
        attention=GQAAttentionSpec(num_kv_heads=2, head_dim=64, backend="flash-attn"),
        attention_layers=_every(4, 12),
        state=gdn_state(num_k_heads=4, num_v_heads=8, k_head_dim=32, v_head_dim=32, conv_kernel=4),
    )


def tiny_deepseek() -> ModelSpec:
    return ModelSpec(
        name="tiny-deepseek",
        architecture="DeepseekV3ForCausalLM",
        num_layers=4,
        hidden_size=256,
        attention=MLAAttentionSpec(kv_lora_rank=56, rope_dim=8, backend="flashmla"),
        attention_layers=tuple(range(4)),
    )


def tiny_llama() -> ModelSpec:
    # 8 KV heads so that TP 8 still splits heads; head_dim 16 keeps rows 32 B (8-byte aligned).
    return ModelSpec(
        name="tiny-llama",
        architecture="LlamaForCausalLM",
        num_layers=4,
        hidden_size=256,
        attention=GQAAttentionSpec(num_kv_heads=8, head_dim=16, backend="flash-attn"),
        attention_layers=tuple(range(4)),
    )


PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "kimi-linear-48b": kimi_linear_48b,
    "qwen3-next-80b": qwen3_next_80b,
    "deepseek-v3": deepseek_v3,
    "llama-3.1-8b": llama_31_8b,
    "tiny-kimi-linear": tiny_kimi_linear,
    "tiny-qwen3-next": tiny_qwen3_next,
    "tiny-deepseek": tiny_deepseek,
    "tiny-llama": tiny_llama,
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str) -> ModelSpec:
    try:
        factory = PRESETS[name]
    except KeyError:
        raise GeometryError(
            f"unknown model preset {name!r}; allowed: {', '.join(preset_names())}"
        ) from None
    return factory()
