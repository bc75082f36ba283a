"""Model cache geometry: specs, presets, Hugging Face configs and per-engine layouts."""

from .layout import EngineLayout, HMAGroup, Region, build_layout, unify_pages
from .presets import PRESETS, preset, preset_names
from .specs import (
    GeometryError,
    GQAAttentionSpec,
    MLAAttentionSpec,
    ModelSpec,
    Sharding,
    StateSpec,
)

__all__ = [
    "EngineLayout", "HMAGroup", "Region", "build_layout", "unify_pages", "PRESETS", "preset",
    "preset_names", "GeometryError", "GQAAttentionSpec", "MLAAttentionSpec", "ModelSpec",
    "Sharding", "StateSpec",
]
