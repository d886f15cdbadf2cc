"""Mixtral: the Llama block with every MLP a sparse block of routed experts (``w1`` gate, ``w3``
up, ``w2`` down under ``block_sparse_moe``), top-k weights renormalized to sum 1."""
from __future__ import annotations

from typing import ClassVar

from treadle.models.layout import LLAMA_NORMS, ExpertsLayout, ModelLayout
from treadle.models.moe import MoeForCausalLM, moe_linears

MIXTRAL_LAYOUT = ModelLayout(
    linears=moe_linears("block_sparse_moe.gate", shared_expert=False),
    norms=LLAMA_NORMS,
    experts=ExpertsLayout("mlp.experts", "block_sparse_moe.experts", ("w1", "w3", "w2")),
)


class MixtralForCausalLM(MoeForCausalLM):
    layout: ClassVar[ModelLayout] = MIXTRAL_LAYOUT
