"""The sparse MLP block of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) and
the Llama decoder built on it: attention as the dense family's, and in each sparse layer
(``cfg.is_sparse_layer``) a router, the routed experts and, for Qwen2-MoE, a shared expert::

    x --router (replicated)--> top-k per token --FusedMoE (this rank's experts / columns)--.
    x --shared_expert (TP-split like a dense MLP) * sigmoid(shared_expert_gate(x)) --------+--> partial
                                                                  sum, all-reduced by the decoder layer

Tensor parallelism without expert parallelism splits every expert's intermediate columns
(and the shared expert's) like a dense MLP; with ``parallel.expert_parallel`` each rank holds
E / T whole experts and computes them for every token. Both leave a partial sum per rank that
the decoder layer's existing all-reduce completes: the simplest correct scheme on gloo (an
all-to-all dispatch moves fewer bytes when T is large; here hidden-sized rows are all-reduced).
"""
from __future__ import annotations

import torch
from torch import nn

from treadle.config import ModelConfig
from treadle.distributed import ParallelContext
from treadle.distributed.sharding import intermediate_unit, partition
from treadle.layers.activation import silu_and_mul
from treadle.layers.moe import FusedMoE, block_inputs, route
from treadle.models.layout import ExpertsLayout, LinearLayout, ModelLayout, Split, hidden, llama_linears
from treadle.models.llama import LlamaForCausalLM, LlamaMLP, MethodFactory, make_linear


def _num_experts(cfg: ModelConfig) -> int:
    assert cfg.moe is not None
    return cfg.moe.num_experts


def _shared(cfg: ModelConfig) -> int:
    assert cfg.moe is not None
    return cfg.moe.shared_expert_intermediate_size


def _one(cfg: ModelConfig) -> int:
    return 1


def moe_linears(router: str, shared_expert: bool) -> tuple[LinearLayout, ...]:
    """Attention (Llama's), the dense MLP of any dense layers, the router (checkpoint name
    ``router``) and optionally Qwen2-MoE's shared expert and its gate."""
    attention, dense = llama_linears()[:2], llama_linears()[2:]
    out = attention + tuple(LinearLayout(lin.name, lin.parts, lin.in_features, lin.split, layers="dense")
                            for lin in dense)
    out += (LinearLayout("mlp.gate", ((router, _num_experts),), hidden, Split.REPLICATED, layers="sparse"),)
    if shared_expert:
        out += (
            LinearLayout("mlp.shared_expert.gate_up_proj", (("mlp.shared_expert.gate_proj", _shared),
                                                            ("mlp.shared_expert.up_proj", _shared)),
                         hidden, Split.COLUMN, layers="sparse"),
            LinearLayout("mlp.shared_expert.down_proj", (("mlp.shared_expert.down_proj", hidden),), _shared,
                         Split.ROW, layers="sparse"),
            LinearLayout("mlp.shared_expert_gate", (("mlp.shared_expert_gate", _one),), hidden,
                         Split.REPLICATED, layers="sparse"),
        )
    return out


QWEN_EXPERTS = ExpertsLayout("mlp.experts", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))


def expert_block_types(w13: object, w2: object, hidden_size: int, columns: range) -> tuple[str, str, str] | None:
    """(gate, up, down) GGUF types when the method factory gives the stacked experts GGUF-block
    methods (a GGUF file's native blocks, or ``--quantization int8 | int4`` quantizing at load)
    whose blocks fit the widths; None: float experts. A method's ``qtypes`` lists its shards'
    types (w13: gate, up of every expert in turn; one name when all alike)."""
    types13, types2 = getattr(w13, "qtypes", None), getattr(w2, "qtypes", None)
    if not types13 or not types2:
        return None
    gate, up, down = types13[0], types13[1 % len(types13)], types2[0]
    fits = all(hidden_size % block_inputs(t) == 0 for t in (gate, up)) and not (
        columns.start % block_inputs(down) or columns.stop % block_inputs(down))
    return (gate, up, down) if fits else None


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ModelLayout, dtype: torch.dtype, method: MethodFactory,
                 prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(layout.linear("mlp.shared_expert.gate_up_proj"), cfg, dtype, method, prefix)
        self.down_proj = make_linear(layout.linear("mlp.shared_expert.down_proj"), cfg, dtype, method, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and optional shared expert of one sparse layer; forward returns
    this rank's partial sum (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout, dtype: torch.dtype, method: MethodFactory,
                 prefix: str, parallel: ParallelContext) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = make_linear(layout.linear("mlp.gate"), cfg, dtype, method, prefix)  # [E, hidden], replicated
        tp, rank, inter = parallel.tp_size, parallel.tp_rank, moe.intermediate_size
        if parallel.expert_parallel:
            start, size = partition(moe.num_experts, tp, rank)
            experts, columns = range(start, start + size), None
        else:
            start, size = partition(inter, tp, rank, intermediate_unit(inter))
            experts, columns = None, range(start, start + size)
        blocks = expert_block_types(method(f"{prefix}.mlp.experts.w13"), method(f"{prefix}.mlp.experts.w2"),
                                    cfg.hidden_size, columns or range(inter))
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, inter, dtype, experts, columns, blocks)
        self.shared_expert: SharedExpert | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg, layout, dtype, method, prefix)
            self.shared_expert_gate = make_linear(layout.linear("mlp.shared_expert_gate"), cfg, dtype, method, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden] -> [T, hidden] partial
        out = self.experts(x, route(self.gate(x), self.top_k, self.renormalize))
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers have a ``SparseMoeBlock`` for an MLP;
    subclasses set the layout (its ``experts`` row) and the attention class."""

    def make_mlp(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, method: MethodFactory,
                 prefix: str) -> nn.Module:
        if cfg.is_sparse_layer(layer):
            return SparseMoeBlock(cfg, self.layout, dtype, method, prefix, self.parallel)
        return LlamaMLP(cfg, self.layout, dtype, method, prefix)
