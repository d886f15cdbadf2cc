"""Attention backends behind one interface, chosen at start-up."""
from treadle.layers.attention.backend import AttentionBackend, AttentionSpec
from treadle.layers.attention.metadata import (
    AttentionMetadata,
    StepInputBuilder,
    StepPlan,
    build_attention_metadata,
)
from treadle.layers.attention.reference import ReferenceBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "ReferenceBackend",
    "StepInputBuilder",
    "StepPlan",
    "build_attention_metadata",
]
