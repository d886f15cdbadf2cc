"""Qwen2-MoE (qkv bias, a sigmoid-gated shared expert beside the routed ones) and Qwen3-MoE
(Qwen3's q/k head norms, no shared expert). Both renormalize the top-k weights only when
``norm_topk_prob``; layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` keep a dense MLP."""
from __future__ import annotations

from typing import ClassVar

from treadle.models.layout import LLAMA_NORMS, ModelLayout
from treadle.models.llama import LlamaAttention
from treadle.models.moe import QWEN_EXPERTS, MoeForCausalLM, moe_linears
from treadle.models.qwen3 import QWEN3_LAYOUT, Qwen3Attention

QWEN2_MOE_LAYOUT = ModelLayout(linears=moe_linears("mlp.gate", shared_expert=True), norms=LLAMA_NORMS,
                               experts=QWEN_EXPERTS)
QWEN3_MOE_LAYOUT = ModelLayout(linears=moe_linears("mlp.gate", shared_expert=False), norms=QWEN3_LAYOUT.norms,
                               experts=QWEN_EXPERTS)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    layout: ClassVar[ModelLayout] = QWEN2_MOE_LAYOUT


class Qwen3MoeForCausalLM(MoeForCausalLM):
    layout: ClassVar[ModelLayout] = QWEN3_MOE_LAYOUT
    attention_cls: ClassVar[type[LlamaAttention]] = Qwen3Attention
