"""One C call per Llama decoder layer on all-decode CPU steps (``csrc/layer.c``).

``layer.c`` chains the kernels the layer's modules would call one by one (same kernels,
same order, same values), so the only difference from the module path is the Python it
skips. A model qualifies (``layer_qtypes``, checked once) with GGUF-block linear layers
(``GGUFBlockMethod``), float32 activations, fused ops on and the kernels built; a step
(checked by the model each step) when the cache is float32 and the attention backend hands
over the step's decode arguments (the CPU backend on an all-decode step).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from treadle.kernels import native

_SIGNATURE = "PPCPPFPPPPPPPPPPPPPIIIIIIIIIFP"


def layer_qtypes(layer: Any) -> ctypes.Array | None:
    """The block types of one LlamaDecoderLayer's qkv / o / gate_up / down weights as the
    kernel's int array, or None when the layer cannot go to it (methods, biases, dtypes)."""
    from treadle.quantization.gguf_native import GGUFBlockMethod

    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    supported = (
        native.available()
        and all(isinstance(m.method, GGUFBlockMethod) for m in linears)
        and (attn.qkv_proj.bias is None or attn.qkv_proj.bias.dtype == torch.float32)
        and all(m.bias is None for m in linears[1:])
        and layer.input_layernorm.fused and attn.rotary.fused
        and layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype == torch.float32
        and attn.rotary.cos_sin.dtype == torch.float32
    )
    return (ctypes.c_int * 4)(*(native.QTYPES[m.method.qtype] for m in linears)) if supported else None


class DecodeStep:
    """The per-step arguments (batch, block tables, scratch) shared by every layer."""

    def __init__(self, kernel_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_size: int,
                 positions: torch.Tensor, hidden: int, qkv: int, q_size: int, inter: int) -> None:
        self.slots, self.tables, self.seq_lens = kernel_args
        self.batch = self.seq_lens.shape[0]
        self.block_size = block_size
        self.positions = positions.to(torch.int64).contiguous()
        self.scratch = torch.empty(self.batch * (2 * hidden + qkv + q_size + 3 * inter), dtype=torch.float32)
        self.fn = native.kernel("tq_llama_layer_decode", _SIGNATURE)

    def run(self, layer: Any, qtypes: ctypes.Array, first: bool, x: torch.Tensor, residual: torch.Tensor,
            kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """x [B, H] (overwritten with the layer's MLP output) and residual [B, H], in place;
        ``qtypes`` from ``layer_qtypes``."""
        attn, mlp, spec = layer.self_attn, layer.mlp, layer.self_attn.spec
        qkv, o, gu, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.fn(
            x.data_ptr(), residual.data_ptr(), int(first), layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(), layer.input_layernorm.eps, ctypes.addressof(qtypes),
            qkv.weight.data_ptr(), None if qkv.bias is None else qkv.bias.data_ptr(), o.weight.data_ptr(),
            gu.weight.data_ptr(), down.weight.data_ptr(), attn.rotary.cos_sin.data_ptr(), self.positions.data_ptr(),
            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), self.slots.data_ptr(), self.tables.data_ptr(),
            self.seq_lens.data_ptr(), self.batch, self.tables.shape[1], self.block_size, x.shape[1],
            spec.num_heads, spec.num_kv_heads, spec.head_dim, down.in_features, spec.sliding_window or 0,
            spec.scale, self.scratch.data_ptr(),
        )
