"""Test helper: GGUF blocks and Llama GGUF files made at test time with the gguf package's writer.

``random_blocks`` writes blocks of any type the C kernels read, byte by byte: every integer
and sub-scale field random (so every bit of the layout is exercised) and the float16 scales
set so weights stay within about +-``target``. The gguf package dequantizes them (its
reference dequantizer is the oracle), which is how types it cannot quantize (the K-quants)
get tested.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter

from treadle.loaders.resolve import resolve_model
from treadle.quantization.methods.gguf_native import GGUFBlocks, block_shape

# byte offsets of a block's float16 fields: the scale d, then the minimum (m or dmin) if any
_HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
# largest |integer| times largest sub-scale a block can hold, and the typical minimum per unit of d
_SPAN = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 127, "Q2_K": 45, "Q3_K": 128, "Q4_K": 945,
         "Q5_K": 1953, "Q6_K": 4096}
_MIN = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def random_blocks(qtype: str, rows: int, cols: int, seed: int, target: float = 0.3) -> GGUFBlocks:
    """[rows, cols] weights as random ``qtype`` blocks (see the module docstring)."""
    inputs, nbytes = block_shape(qtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // inputs, nbytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, size=(raw.shape[0], 1)) * target / _SPAN[qtype]
    fields = _HALF_FIELDS[qtype]
    raw[:, fields[0] : fields[0] + 2] = d.astype(np.float16).view(np.uint8)
    if len(fields) > 1:
        raw[:, fields[1] : fields[1] + 2] = (d * _MIN[qtype]).astype(np.float16).view(np.uint8)
    return GGUFBlocks(qtype, torch.from_numpy(raw.reshape(rows, -1)), (rows, cols))


def to_interleaved(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (rotate-half -> adjacent pairs)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"


def write_shape(w: GGUFWriter, config, rope_theta: float) -> None:  # noqa: ANN001 (a transformers config)
    """The decoder's hyperparameters every architecture writes alike."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)


def write_llama_metadata(w: GGUFWriter, config, tokenizer: str = "llama") -> None:  # noqa: ANN001 (a LlamaConfig)
    """Llama hyperparameters from ``config``, and (tokenizer "llama") the stories260K vocabulary."""
    write_shape(w, config, 10000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer == "llama":  # the stories260K vocabulary, SentencePiece style
        tok = json.loads((resolve_model("stories260k") / "tokenizer.json").read_text())
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        w.add_tokenizer_model("llama")
        w.add_token_list([p for p, _ in vocab])
        w.add_token_scores([-float(i) for _, i in vocab])  # tok512.bin scores pieces by -(rank)
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(vocab) - 259))
        w.add_unk_token_id(0)
        w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def finish(w: GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@contextlib.contextmanager
def fast_gguf_parsing(parsed: dict[tuple[str, str], object] | None = None) -> Iterator[None]:
    """While transformers loads a GGUF (``from_pretrained(..., gguf_file=)``): it parses the file
    with the gguf package's ``GGUFReader`` twice (config, then weights), and that reader's
    per-slice ``np.memmap`` bookkeeping makes a large vocabulary's ~10^6 small slices slow
    (Gemma 3's 262k tokens: 17.6 s CPU a parse). Treadle's reader subclass parses the same bytes
    with the same code over a plain view of the map (4.4 s), and one parse per file serves both
    reads (the reader is read-only); swapped in only for the duration. ``parsed``: a dict kept by
    the caller, to share the parses with later loads of the same file (a model, then its tokenizer)."""
    import gguf

    from treadle.loaders.gguf import PlainBufferReader

    if parsed is None:
        parsed = {}

    def reader(path: str | Path, mode: str = "r") -> PlainBufferReader:
        key = (str(path), mode)
        if key not in parsed:
            parsed[key] = PlainBufferReader(path, mode)  # type: ignore[arg-type]
        return parsed[key]

    original = gguf.GGUFReader
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
