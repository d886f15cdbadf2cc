"""An architecture's parameters, declared once: the table every other part reads.

Each model file declares one ``ModelLayout``; loading (checkpoint name -> parameter and
shard), the expected-tensor check, weight byte counts, quantized packing (which checkpoint
tensors make up one linear layer, its input width) and the fused decode layer all derive
from it, and tensor parallelism reads each parameter's ``Split``::

    checkpoint (HF names)                    model (our modules)
    model.layers.3.self_attn.q_proj.weight --.
    model.layers.3.self_attn.k_proj.weight ---+-> layers.3.self_attn.qkv_proj.weight  rows [q | k | v]
    model.layers.3.self_attn.v_proj.weight --'    (a Phi-3 checkpoint holds qkv_proj itself)
    model.layers.3.mlp.gate_proj.weight ------+-> layers.3.mlp.gate_up_proj.weight    rows [gate | up]
    model.layers.3.mlp.up_proj.weight --------'

Sizes are functions of ModelConfig, so one table serves every size of an architecture.
Adding an architecture: a model file with its layout, a registry entry (see
``treadle/models/registry.py``), and its config fields in ``ModelConfig.from_hf``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from treadle.config import ModelConfig

SizeFn = Callable[[ModelConfig], int]
Shape = tuple[int, ...]


class Split(StrEnum):
    """How tensor parallelism divides a parameter across ranks."""

    COLUMN = "column"  # output rows (each part of a packed layer divided separately)
    ROW = "row"  # input columns; the ranks' outputs are summed
    VOCAB = "vocab"  # rows by vocabulary range (embedding, lm_head)
    REPLICATED = "replicated"  # every rank holds all of it (norms)


def _no(cfg: ModelConfig) -> bool:
    return False


@dataclass(frozen=True)
class LinearLayout:
    """One linear module of a decoder layer, possibly several projections stacked row-wise."""

    name: str  # module path inside a decoder layer, e.g. "self_attn.qkv_proj"
    parts: tuple[tuple[str, SizeFn], ...]  # (logical projection's checkpoint name, its rows), in row order
    in_features: SizeFn
    split: Split
    bias: Callable[[ModelConfig], bool] = _no
    packed_in_checkpoint: bool = False  # the checkpoint holds ``name`` itself, not its parts
    layers: str = "all"  # which decoder layers hold it: "all", or (MoE models) "dense" / "sparse"

    def present(self, cfg: ModelConfig, layer: int) -> bool:
        return self.layers == "all" or (self.layers == "sparse") == cfg.is_sparse_layer(layer)

    def output_sizes(self, cfg: ModelConfig) -> list[int]:
        return [rows(cfg) for _, rows in self.parts]

    def checkpoint_names(self) -> tuple[str, ...]:
        """The module paths this layer's tensors have in a checkpoint, in shard order."""
        return (self.name,) if self.packed_in_checkpoint else tuple(name for name, _ in self.parts)


@dataclass(frozen=True)
class ExpertsLayout:
    """A sparse layer's routed experts (SwiGLU MLPs, ``cfg.moe``): one checkpoint tensor per
    expert and projection, held by the model stacked by expert (``treadle.layers.moe``)::

        {checkpoint}.{e}.{gate}.weight [I, hidden] --.
        {checkpoint}.{e}.{up}.weight   [I, hidden] ---+-> {name}.w13 [E, 2I, hidden], shard 2e (gate), 2e + 1 (up)
        {checkpoint}.{e}.{down}.weight [hidden, I] ----> {name}.w2  [E, hidden, I],  shard e

    Tensor parallelism cuts them in the layer's own weight loader (each expert's I columns, or
    whole experts under expert parallelism), not by ``Split``."""

    name: str  # our module path inside a decoder layer, e.g. "mlp.experts"
    checkpoint: str  # the checkpoint's: "mlp.experts" (Qwen), "block_sparse_moe.experts" (Mixtral)
    projections: tuple[str, str, str]  # gate, up, down: ("gate_proj", "up_proj", "down_proj") or ("w1", "w3", "w2")

    def expected_tensors(self, cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
        assert cfg.moe is not None
        h, inter = cfg.hidden_size, cfg.moe.intermediate_size
        gate, up, down = self.projections
        shapes: dict[str, Shape] = {}
        for e in range(cfg.moe.num_experts):
            p = f"{prefix}.{self.checkpoint}.{e}"
            shapes |= {f"{p}.{gate}.weight": (inter, h), f"{p}.{up}.weight": (inter, h), f"{p}.{down}.weight": (h, inter)}
        return shapes

    def parameter_for(self, module: str) -> tuple[str, int] | None:
        """A decoder-layer module path (``block_sparse_moe.experts.5.w3``) -> (our parameter
        inside the layer, shard), or None when it is not an expert's."""
        if not module.startswith(self.checkpoint + "."):
            return None
        index, _, proj = module[len(self.checkpoint) + 1:].partition(".")
        if not index.isdigit() or proj not in self.projections:
            return None
        j = self.projections.index(proj)
        return (f"{self.name}.w2", int(index)) if j == 2 else (f"{self.name}.w13", 2 * int(index) + j)

    def shard_names(self, layer_stem: str, param: str, cfg: ModelConfig) -> list[str]:
        """The checkpoint weights behind stacked parameter ``param`` ("w13" or "w2") of decoder
        layer ``layer_stem`` (``model.layers.3``), in shard order."""
        assert cfg.moe is not None
        gate, up, down = self.projections
        projections = (gate, up) if param == "w13" else (down,)
        return [f"{layer_stem}.{self.checkpoint}.{e}.{p}.weight" for e in range(cfg.moe.num_experts)
                for p in projections]


@dataclass(frozen=True)
class NormLayout:
    name: str  # module path inside a decoder layer, e.g. "input_layernorm"
    size: SizeFn


@dataclass(frozen=True)
class ModelLayout:
    """The parameter table of one architecture (decoder layers plus the global tensors)."""

    linears: tuple[LinearLayout, ...]  # per decoder layer
    norms: tuple[NormLayout, ...]  # per decoder layer, in the order the layer applies them
    layer_prefix: str = "model.layers"
    embed: str = "model.embed_tokens"  # [vocab, hidden], Split.VOCAB
    final_norm: str = "model.norm"  # [hidden], Split.REPLICATED
    lm_head: str = "lm_head"  # [vocab, hidden], Split.VOCAB; tied to ``embed`` when the config says so
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    experts: ExpertsLayout | None = None  # MoE models: the sparse layers' routed experts

    def linear(self, name: str) -> LinearLayout:
        return next(lin for lin in self.linears if lin.name == name)

    @property
    def has_standard_block(self) -> bool:
        """True when a decoder layer is exactly norm, qkv, RoPE, attention, o, norm, gate_up,
        SwiGLU, down: the block the fused C decode layer implements."""
        return {lin.name for lin in self.linears} == set(STANDARD_LINEARS) and tuple(
            n.name for n in self.norms) == ("input_layernorm", "post_attention_layernorm")

    def splits(self) -> dict[str, Split]:
        """Tensor-parallel split of each module, by layer name as the method factory sees it
        (decoder-layer modules as ``model.layers.*.<name>``)."""
        out = {self.embed: Split.VOCAB, self.final_norm: Split.REPLICATED, self.lm_head: Split.VOCAB}
        out |= {f"{self.layer_prefix}.*.{lin.name}": lin.split for lin in self.linears}
        return out | {f"{self.layer_prefix}.*.{n.name}": Split.REPLICATED for n in self.norms}

    # -- checkpoint names ---------------------------------------------------------------
    def expected_tensors(self, cfg: ModelConfig) -> dict[str, Shape]:
        """Every tensor a checkpoint of this architecture must hold, by HF name and shape."""
        h = cfg.hidden_size
        shapes: dict[str, Shape] = {f"{self.embed}.weight": (cfg.vocab_size, h), f"{self.final_norm}.weight": (h,)}
        if not cfg.tie_word_embeddings:
            shapes[f"{self.lm_head}.weight"] = (cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            p = f"{self.layer_prefix}.{i}"
            shapes |= {f"{p}.{n.name}.weight": (n.size(cfg),) for n in self.norms}
            if self.experts is not None and cfg.is_sparse_layer(i):
                shapes |= self.experts.expected_tensors(cfg, p)
            for lin in self.linears:
                if not lin.present(cfg, i):
                    continue
                sizes = lin.output_sizes(cfg)
                rows = [sum(sizes)] if lin.packed_in_checkpoint else sizes
                for name, r in zip(lin.checkpoint_names(), rows):
                    shapes[f"{p}.{name}.weight"] = (r, lin.in_features(cfg))
                    if lin.bias(cfg):
                        shapes[f"{p}.{name}.bias"] = (r,)
        return shapes

    def is_ignored(self, name: str, cfg: ModelConfig) -> bool:
        """Tensors a checkpoint may carry that the model does not use (never read)."""
        return name.endswith(self.ignored_suffixes) or (cfg.tie_word_embeddings and name == f"{self.lm_head}.weight")

    def parameter_for(self, hf_name: str) -> tuple[str, int | None]:
        """A checkpoint tensor's (model parameter name, shard of a packed layer or None)."""
        name = hf_name.removeprefix("model.")
        layer_prefix = self.layer_prefix.removeprefix("model.") + "."
        lin, shard = self.linear_for(hf_name)
        index, _, module = name[len(layer_prefix):].rpartition(".")[0].partition(".")
        if lin is not None:
            return f"{layer_prefix}{index}.{lin.name}.{hf_name.rpartition('.')[2]}", shard
        expert = None if self.experts is None or not name.startswith(layer_prefix) else self.experts.parameter_for(module)
        if expert is not None:
            return f"{layer_prefix}{index}.{expert[0]}", expert[1]
        return name, None

    def linear_for(self, hf_name: str) -> tuple[LinearLayout | None, int | None]:
        """The decoder-layer linear a checkpoint tensor belongs to and its shard of a packed
        layer (None when the checkpoint holds the layer whole), or (None, None)."""
        name = hf_name.removeprefix("model.")
        layer_prefix = self.layer_prefix.removeprefix("model.") + "."
        if name.startswith(layer_prefix):
            module = name[len(layer_prefix):].partition(".")[2].rpartition(".")[0]
            for lin in self.linears:
                names = lin.checkpoint_names()
                if module in names:
                    return lin, None if len(names) == 1 else names.index(module)
        return None, None

    def layer_index(self, hf_name: str) -> int | None:
        """The decoder layer a checkpoint tensor belongs to, or None for global tensors."""
        name, prefix = hf_name.removeprefix("model."), self.layer_prefix.removeprefix("model.") + "."
        head = name[len(prefix):].partition(".")[0] if name.startswith(prefix) else ""
        return int(head) if head.isdigit() else None

    def shard_names(self, layer_name: str, cfg: ModelConfig | None = None) -> list[str]:
        """A linear layer's checkpoint weight names, in shard order:
        ``model.layers.3.self_attn.qkv_proj`` -> its q_proj, k_proj, v_proj weights (with ``cfg``,
        a MoE's stacked experts too: ``model.layers.3.mlp.experts.w13`` -> every expert's gate, up)."""
        module, _, param = layer_name.rpartition(".")
        if self.experts is not None and cfg is not None and module.endswith("." + self.experts.name):
            return self.experts.shard_names(module.removesuffix("." + self.experts.name), param, cfg)
        stem, lin = self._layer_linear(layer_name)
        if lin is None:
            return [f"{layer_name}.weight"]
        return [f"{stem}.{name}.weight" for name in lin.checkpoint_names()]

    def in_features(self, cfg: ModelConfig, layer_name: str) -> int:
        """The input width of the linear layer ``layer_name`` (embedding and lm_head: hidden)."""
        _, lin = self._layer_linear(layer_name)
        return cfg.hidden_size if lin is None else lin.in_features(cfg)

    def _layer_linear(self, layer_name: str) -> tuple[str, LinearLayout | None]:
        for lin in self.linears:
            if layer_name.endswith("." + lin.name):
                return layer_name.removesuffix("." + lin.name), lin
        return layer_name, None

    def weight_bytes(self, cfg: ModelConfig, element_size: int) -> int:
        """Bytes of the model's weights held unquantized at ``element_size`` bytes each."""
        return sum(math.prod(s) for s in self.expected_tensors(cfg).values()) * element_size


# -- the Llama decoder block, shared by the families built on it ------------------------------
def q_size(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def kv_size(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


def hidden(cfg: ModelConfig) -> int:
    return cfg.hidden_size


def intermediate(cfg: ModelConfig) -> int:
    return cfg.intermediate_size


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim


def qkv_bias(cfg: ModelConfig) -> bool:
    return cfg.qkv_bias


STANDARD_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def llama_linears(packed_in_checkpoint: bool = False) -> tuple[LinearLayout, ...]:
    """qkv / o / gate_up / down of a Llama-style block (``packed_in_checkpoint``: the file holds
    qkv_proj and gate_up_proj already stacked, as Phi-3's does)."""
    return (
        LinearLayout("self_attn.qkv_proj",
                     (("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size), ("self_attn.v_proj", kv_size)),
                     hidden, Split.COLUMN, qkv_bias, packed_in_checkpoint),
        LinearLayout("self_attn.o_proj", (("self_attn.o_proj", hidden),), q_size, Split.ROW),
        LinearLayout("mlp.gate_up_proj", (("mlp.gate_proj", intermediate), ("mlp.up_proj", intermediate)),
                     hidden, Split.COLUMN, _no, packed_in_checkpoint),
        LinearLayout("mlp.down_proj", (("mlp.down_proj", hidden),), intermediate, Split.ROW),
    )


LLAMA_NORMS = (NormLayout("input_layernorm", hidden), NormLayout("post_attention_layernorm", hidden))
