"""Phi-3: the Llama block, with q/k/v and gate/up already stacked in the checkpoint
(``qkv_proj``, ``gate_up_proj``); only the layout differs."""
from __future__ import annotations

from typing import ClassVar

from treadle.models.layout import LLAMA_NORMS, ModelLayout, llama_linears
from treadle.models.llama import LlamaForCausalLM

PHI3_LAYOUT = ModelLayout(linears=llama_linears(packed_in_checkpoint=True), norms=LLAMA_NORMS)


class Phi3ForCausalLM(LlamaForCausalLM):
    layout: ClassVar[ModelLayout] = PHI3_LAYOUT
