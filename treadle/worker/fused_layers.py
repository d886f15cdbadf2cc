"""The runner's planner for the CPU fast path: after loading, each decoder layer the C
decode layer can run is replaced by a ``FusedDecoderLayer`` holding its weights.

A layer qualifies when its architecture has the standard Llama block (its layout says so:
no extra norms such as Qwen3's q/k norms), each of its four linear layers holds GGUF blocks
(``GGUFBlockMethod``: a GGUF file, or ``--quantization int8|int4``) or bfloat16 rows on the C
kernel (``BFloat16CPUMethod``: a float checkpoint in ``--dtype bfloat16``), only qkv has a bias
(float32), the norms and RoPE are float32 with fused ops on, and the C kernels are built.
When every layer of a one-stage, one-rank model is fused, the model also gets a
``FusedDecoderStack``: all layers as one C call per all-decode step. Nothing here runs per
step: the fused layers and the stack check each step themselves.

Gemma 3 (its own block: q/k head norms, output norms, GeGLU) gets ``FusedGemmaStack`` when
every layer qualifies as above and its extra norms are float32 and fused: the whole stack as
one C call (``csrc/gemma_layer.c``), its layers' modules kept for every other step.
"""
from __future__ import annotations

import torch

from treadle.kernels import native
from treadle.kernels.gemma_layer import GemmaLayerWeights
from treadle.kernels.layer import DecoderLayerWeights, block_layouts
from treadle.layers.fused_decoder import FusedDecoderLayer, FusedDecoderStack, Workspace
from treadle.layers.fused_gemma import FusedGemmaStack
from treadle.layers.linear import Linear
from treadle.layers.norm import RMSNorm
from treadle.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM
from treadle.models.layout import STANDARD_LINEARS
from treadle.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from treadle.quantization.methods.bfloat16_cpu import BFloat16CPUMethod
from treadle.quantization.methods.gguf_native import GGUFBlockMethod


def _linear(layer: LlamaDecoderLayer, name: str) -> Linear:
    module = layer.get_submodule(name)
    assert isinstance(module, Linear), name
    return module


def _segments(linear: Linear) -> native.Segments | None:
    """The linear layer's weight as tq_layout segments, or None when the C layer cannot read it."""
    if isinstance(linear.method, GGUFBlockMethod):
        return linear.method.segments
    if isinstance(linear.method, BFloat16CPUMethod) and BFloat16CPUMethod.on_kernel(linear):
        return (("BF16", linear.out_features),)
    return None


def layer_weights(layer: LlamaDecoderLayer) -> DecoderLayerWeights | None:
    """The C layer's view of one Llama-style decoder layer, or None when it cannot take it."""
    linears = [_linear(layer, name) for name in STANDARD_LINEARS]
    qkv, o, gate_up, down = linears
    segments = [s for s in map(_segments, linears) if s is not None]
    attn, in_norm, post_norm = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    f32 = torch.float32
    if not (
        len(segments) == len(linears)
        and (qkv.bias is None or qkv.bias.dtype == f32)
        and all(m.bias is None for m in linears[1:])
        and in_norm.fused and post_norm.fused and attn.rotary.fused
        and in_norm.weight.dtype == post_norm.weight.dtype == attn.rotary.cos_sin.dtype == f32
    ):
        return None
    spec = attn.spec
    return DecoderLayerWeights(
        layouts=block_layouts(segments),
        input_norm=in_norm.weight.data, post_norm=post_norm.weight.data, eps=in_norm.eps,
        qkv=qkv.weight.data, qkv_bias=None if qkv.bias is None else qkv.bias.data, o=o.weight.data,
        gate_up=gate_up.weight.data, down=down.weight.data, cos_sin=attn.rotary.cos_sin,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate=down.in_features, sliding_window=spec.sliding_window, scale=spec.scale,
    )


def gemma_weights(layer: Gemma3DecoderLayer) -> GemmaLayerWeights | None:
    """The C layer's view of one Gemma 3 decoder layer, or None when it cannot take it."""
    base, attn = layer_weights(layer), layer.self_attn
    assert isinstance(attn, Gemma3Attention)
    norms: list[RMSNorm] = [attn.q_norm, attn.k_norm, layer.pre_feedforward_layernorm,
                            layer.post_feedforward_layernorm]
    if base is None or not all(n.fused and n.weight.dtype == torch.float32 and n.eps == base.eps for n in norms):
        return None
    return GemmaLayerWeights(base, *(n.weight.data for n in norms))


def _fuse_gemma(model: Gemma3ForCausalLM) -> int:
    """The whole stack as one FusedGemmaStack when every layer qualifies (one stage, one rank)."""
    layers = [x for x in model.layers if isinstance(x, Gemma3DecoderLayer)]
    if not (model.parallel.tp_size == 1 and len(model.stage) == len(layers) == len(model.layers)):
        return 0
    weights = [gemma_weights(x) for x in layers]
    if any(w is None for w in weights):
        return 0
    model.decoder = FusedGemmaStack([w for w in weights if w is not None], model.decoder)
    return len(layers)


def fuse_decoder_layers(model: LlamaForCausalLM) -> int:
    """Swap ``model.layers[i]`` for a FusedDecoderLayer wherever it qualifies; returns how
    many were swapped (0 for architectures without the standard block or without kernels).
    Gemma 3: its whole stack or nothing (the count of its layers, or 0)."""
    if native.available() and isinstance(model, Gemma3ForCausalLM):
        return 0 if isinstance(model.decoder, FusedGemmaStack) else _fuse_gemma(model)
    if not (native.available() and model.layout.has_standard_block):
        return 0
    workspace = Workspace()
    swapped = 0
    for i, layer in enumerate(model.layers):
        if not isinstance(layer, LlamaDecoderLayer):  # already swapped
            continue
        weights = layer_weights(layer)
        if weights is not None:
            model.layers[i] = FusedDecoderLayer(layer, weights, workspace)
            swapped += 1
    fused = [x for x in model.layers if isinstance(x, FusedDecoderLayer)]
    if model.parallel.tp_size == 1 and len(model.stage) == len(fused) == len(model.layers):
        model.decoder = FusedDecoderStack(fused, model.decoder)  # the whole stack in one call
    return swapped
