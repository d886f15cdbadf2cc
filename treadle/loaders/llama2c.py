"""llama2.c checkpoints (version 0, float32) and tokenizer.bin -> a Hugging Face directory.

Checkpoint layout: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len; vocab_size < 0 means an unshared classifier follows), then
float32 arrays, each stacked over layers::

    tok_embeddings [vocab, dim]
    rms_att [L, dim] | wq [L, dim, dim] | wk [L, kv_dim, dim] | wv [L, kv_dim, dim] | wo [L, dim, dim]
    rms_ffn [L, dim] | w1 [L, hidden, dim] | w2 [L, dim, hidden] | w3 [L, hidden, dim]
    rms_final [dim] | freq_cis_real, freq_cis_imag [seq_len, head_dim/2] (unused) | wcls [vocab, dim]?

Tokenizer layout: int32 max_token_length, then per token: float32 score,
int32 byte length, the bytes (spaces written as ' ', BOS/EOS as "\\n<s>\\n" / "\\n</s>\\n").
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import save_file

from treadle.config import TreadleError
from treadle.loaders.rotary_layout import interleaved_to_rotate_half
from treadle.tokenizer import Tokenizer
from treadle.vocab import SPACE_MARK, TokenType, sentencepiece_bpe

_HEADER = struct.Struct("<7i")
_UNK, _BOS, _EOS = 0, 1, 2


class Llama2cHeader(NamedTuple):
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool


def _read_header(data: bytes, path: Path) -> Llama2cHeader:
    if len(data) < _HEADER.size:
        raise TreadleError(f"{path}: too short to be a llama2.c checkpoint")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _HEADER.unpack_from(data)
    if dim == 0x616B3432:  # "ak42": the versioned export formats
        raise TreadleError(f"{path}: llama2.c checkpoint versions 1+ are not supported (export with --version 0)")
    if min(dim, hidden, layers, heads, kv_heads, seq_len, abs(vocab)) <= 0 or dim % heads or heads % kv_heads:
        raise TreadleError(f"{path}: implausible llama2.c header {(dim, hidden, layers, heads, kv_heads, vocab, seq_len)}")
    return Llama2cHeader(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, vocab > 0)


def read_llama2c_checkpoint(path: Path) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Header and Hugging Face-named float32 tensors (q/k rows in rotate-half order)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TreadleError(f"{path}: cannot read ({e.strerror})") from None
    h = _read_header(data, path)
    head_dim = h.dim // h.n_heads
    kv_dim = h.n_kv_heads * head_dim
    L = h.n_layers
    shapes = {
        "embed": (h.vocab_size, h.dim), "rms_att": (L, h.dim), "wq": (L, h.dim, h.dim), "wk": (L, kv_dim, h.dim),
        "wv": (L, kv_dim, h.dim), "wo": (L, h.dim, h.dim), "rms_ffn": (L, h.dim), "w1": (L, h.hidden_dim, h.dim),
        "w2": (L, h.dim, h.hidden_dim), "w3": (L, h.hidden_dim, h.dim), "rms_final": (h.dim,),
        "freq_cis": (2, h.seq_len, head_dim // 2),
    }
    if not h.shared_classifier:
        shapes["wcls"] = (h.vocab_size, h.dim)
    expected = _HEADER.size + 4 * sum(int(np.prod(s)) for s in shapes.values())
    if len(data) != expected:
        raise TreadleError(f"{path}: {len(data)} bytes, but its header implies {expected} (truncated or wrong format)")
    floats = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    arrays: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        arrays[name] = torch.from_numpy(floats[offset : offset + n].reshape(shape).copy())
        offset += n
    return h, _hf_tensors(h, arrays)


def _hf_tensors(h: Llama2cHeader, a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": a["embed"], "model.norm.weight": a["rms_final"]}
    if "wcls" in a:
        out["lm_head.weight"] = a["wcls"]
    for i in range(h.n_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = a["rms_att"][i]
        out[f"{p}.self_attn.q_proj.weight"] = interleaved_to_rotate_half(a["wq"][i], h.n_heads)
        out[f"{p}.self_attn.k_proj.weight"] = interleaved_to_rotate_half(a["wk"][i], h.n_kv_heads)
        out[f"{p}.self_attn.v_proj.weight"] = a["wv"][i].contiguous()
        out[f"{p}.self_attn.o_proj.weight"] = a["wo"][i].contiguous()
        out[f"{p}.post_attention_layernorm.weight"] = a["rms_ffn"][i]
        out[f"{p}.mlp.gate_proj.weight"] = a["w1"][i].contiguous()
        out[f"{p}.mlp.down_proj.weight"] = a["w2"][i].contiguous()
        out[f"{p}.mlp.up_proj.weight"] = a["w3"][i].contiguous()
    return {k: v.contiguous().clone() for k, v in out.items()}


def read_llama2c_tokenizer(path: Path, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """Pieces (SentencePiece spelling), scores and llama.cpp token types."""
    try:
        data = path.read_bytes()
        offset = 4
        pieces, scores = [], []
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or offset + length > len(data):
                raise ValueError("piece runs past the end of the file")
            pieces.append(data[offset : offset + length].decode("utf-8"))
            scores.append(score)
            offset += length
    except (OSError, struct.error, ValueError) as e:
        raise TreadleError(f"{path}: not a llama2.c tokenizer with {vocab_size} tokens ({e})") from None
    pieces = [p.replace(" ", SPACE_MARK) for p in pieces]
    pieces[_UNK], pieces[_BOS], pieces[_EOS] = "<unk>", "<s>", "</s>"
    types = [TokenType.NORMAL] * vocab_size
    types[_UNK] = TokenType.UNKNOWN
    types[_BOS] = types[_EOS] = TokenType.CONTROL
    for i, p in enumerate(pieces):
        if len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            types[i] = TokenType.BYTE
    return pieces, scores, [int(t) for t in types]


def _hf_config(h: Llama2cHeader) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h.dim,
        "intermediate_size": h.hidden_dim,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.n_heads,
        "num_key_value_heads": h.n_kv_heads,
        "head_dim": h.dim // h.n_heads,
        "vocab_size": h.vocab_size,
        "max_position_embeddings": h.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": h.shared_classifier,
        "bos_token_id": _BOS,
        "eos_token_id": _EOS,
        "dtype": "float32",
    }


def convert_llama2c(checkpoint: Path, tokenizer: Path, out_dir: Path) -> None:
    """Write an HF directory. Generation stops on EOS and on BOS: llama2.c models
    separate stories with BOS and practically never emit EOS."""
    header, tensors = read_llama2c_checkpoint(checkpoint)
    pieces, scores, types = read_llama2c_tokenizer(tokenizer, header.vocab_size)
    backend = sentencepiece_bpe(pieces, scores, types, unk_id=_UNK, add_space_prefix=True)
    Tokenizer(backend, bos_token="<s>", eos_token="</s>", add_bos_token=True)  # writes the BOS post-processor
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    backend.save(str(out_dir / "tokenizer.json"))
    files = {
        "config.json": _hf_config(header),
        "generation_config.json": {"bos_token_id": _BOS, "eos_token_id": [_EOS, _BOS]},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": header.seq_len,
            "clean_up_tokenization_spaces": False,
        },
    }
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
