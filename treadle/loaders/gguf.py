"""GGUF files (llama.cpp's format) with the ``gguf`` package's reader.

Two stages, so quantized weights can later be kept quantized:

    gguf_tensor_refs()   (hf_name, raw GGUF tensor, rope heads)   -- no data read
          |
    dequantize_ref()     float32 torch tensor in HF layout        -- one tensor at a time

The llama.cpp converter permutes q/k rows into the interleaved RoPE layout; a ref
says how many heads to un-permute (``rope_heads``), which moves whole rows and so
applies equally to quantized rows.
"""
from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from treadle.config import ModelConfig, RopeScaling, TreadleError
from treadle.loaders import gguf_gemma3, gguf_moe
from treadle.loaders.expected import check_tensors
from treadle.loaders.rotary_layout import interleaved_to_rotate_half
from treadle.loaders.source import ModelSource
from treadle.quantization.methods.gguf_native import GGUFBlocks
from treadle.tokenizer import Tokenizer

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFTensorRef(NamedTuple):
    hf_name: str
    tensor: ReaderTensor  # raw: type, GGUF shape, memory-mapped bytes
    shape: tuple[int, ...]  # HF (torch) order, e.g. [out_features, in_features]
    rope_heads: int | None  # q/k rows to convert with interleaved_to_rotate_half, else None
    shift: float = 0.0  # subtracted from the stored values (Gemma's norms: the file holds 1 + w)
    expert: int | None = None  # stacked experts (``gguf_moe``): the slice of the first axis this ref reads


def hf_tensor_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str | None:
    """GGUF tensor name -> Hugging Face name (None when unknown); ``layer_names``: the
    architecture's decoder-layer table (Llama's, or ``gguf_gemma3.LAYER_NAMES``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/values, decoded to Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


class PlainBufferReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same bytes, but
    each of the ~10^5 small slices made while parsing a vocabulary skips np.memmap's
    per-slice bookkeeping (about 3x faster to open; the map stays alive as the view's base)."""

    def _build_fields(self, offs: int, count: int) -> int:
        self.data = self.data.view(np.ndarray)  # type: ignore[assignment]
        return super()._build_fields(offs, count)


class MetadataReader(PlainBufferReader):
    """PlainBufferReader that parses a metadata array in one step instead of one per element
    (the gguf package makes ~3 numpy views per element: Gemma 3's 262k-token vocabulary then
    took ~8 s of its ~10 s load): a number array is one view of all its values, a string array
    one memoryview slice per string, so ``contents()`` of the whole field gives the same list.
    Only for Treadle's own reads (``read_metadata``, whole fields): a field's ``parts`` and
    ``data`` are not one part per element, which transformers' GGUF loader expects (its tests
    keep PlainBufferReader)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or not np.little_endian:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, itype]
        if itype != GGUFValueType.STRING:  # arrays of arrays: the package's own parse
            return super()._get_field_parts(orig_offs, raw_type)
        buf = np.asarray(self.data).data  # the bytes (uint8), as a memoryview
        strings: list[Any] = []
        for _ in range(count):
            n = int.from_bytes(buf[offs : offs + 8], "little")
            strings.append(buf[offs + 8 : offs + 8 + n])
            offs += 8 + n
        return offs - orig_offs, [raw_itype, alen, *strings], list(range(2, 2 + count)), [GGUFValueType.ARRAY, itype]


def release_pages(reader: GGUFReader) -> None:
    """Drop the memory map's pages from this process's resident set once every tensor has been
    copied out (they stay in the page cache; a later read faults them back in), so a loaded
    model's resident weights are its copies alone, not the copies plus the mapped file."""
    base = reader.data
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    mm = getattr(base, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)
    _trim_heap()


def _trim_heap() -> None:
    """Hand the heap freed by the load's temporaries (copies out of the map, q/k row reorders)
    back to the system (glibc's malloc_trim; elsewhere nothing): ~40 MB of a 1.1B model's load."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def open_gguf_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise TreadleError(f"{path}: no such file")
    try:
        return MetadataReader(path, "r")
    except Exception as e:  # the reader fails with struct/numpy/Value errors on damaged files
        raise TreadleError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None


def _rope_scaling(md: dict[str, Any], path: Path, arch: str = "llama") -> RopeScaling | None:
    """As llama.cpp reads it: the type defaults to linear, the factor comes from
    ``rope.scaling.factor`` or the older ``rope.scale_linear``, and a factor of 0 or 1 (or none)
    scales nothing."""
    kind = md.get(f"{arch}.rope.scaling.type", "linear")
    if kind == "none":
        return None
    factor = float(md.get(f"{arch}.rope.scaling.factor") or md.get(f"{arch}.rope.scale_linear") or 0.0)
    if factor in (0.0, 1.0):
        return None
    if kind != "linear":
        raise TreadleError(f"{path}: rope scaling {kind!r} is not supported (supported: linear)")
    return RopeScaling(kind="linear", factor=factor)


def gguf_model_config(md: dict[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch == "gemma3":
        return gguf_gemma3.gemma3_model_config(md, tensor_names, path, _rope_scaling(md, path, "gemma3"))
    if gguf_moe.is_moe(md):
        return gguf_moe.moe_model_config(md, tensor_names, path, _rope_scaling(md, path, str(arch)))
    if arch != "llama":
        raise TreadleError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama, gemma3, qwen2moe, qwen3moe)")
    if "rope_freqs.weight" in tensor_names:
        raise TreadleError(f"{path}: per-dimension rope frequency factors (rope_freqs) are not supported")
    try:
        heads = int(md["llama.attention.head_count"])
        hidden = int(md["llama.embedding_length"])
        head_dim = int(md.get("llama.attention.key_length") or md.get("llama.rope.dimension_count") or hidden // heads)
        eos = md.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=int(md.get("llama.vocab_size") or len(md["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(md["llama.feed_forward_length"]),
            num_layers=int(md["llama.block_count"]),
            num_heads=heads,
            num_kv_heads=int(md.get("llama.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(md["llama.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(md.get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(md.get("llama.context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling=_rope_scaling(md, path),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TreadleError(f"{path}: missing or invalid metadata {e}") from None


def gguf_tensor_refs(reader: GGUFReader, config: ModelConfig, path: Path) -> Iterator[GGUFTensorRef]:
    """Every tensor the model uses, HF-named, before any data is read or dequantized."""
    if config.moe is not None:
        yield from _moe_tensor_refs(reader, config, path)
        return
    gemma = config.architecture == "Gemma3ForCausalLM"
    for t in reader.tensors:
        hf_name = hf_tensor_name(t.name, gguf_gemma3.LAYER_NAMES if gemma else _LAYER_NAMES)
        if hf_name is None:
            raise TreadleError(f"{path}: tensor {t.name!r} has no place in a {config.architecture} model")
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise TreadleError(
                f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported (supported: {names})"
            )
        rope_heads = None  # Gemma: NEOX-style RoPE, q/k rows already in Hugging Face's order
        if not gemma and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            rope_heads = config.num_heads
        elif not gemma and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            rope_heads = config.num_kv_heads
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        shift = gguf_gemma3.NORM_SHIFT if gemma and hf_name.endswith("norm.weight") else 0.0
        yield GGUFTensorRef(hf_name, t, shape, rope_heads, shift)


def _moe_tensor_refs(reader: GGUFReader, config: ModelConfig, path: Path) -> Iterator[GGUFTensorRef]:
    """``gguf_tensor_refs`` of a mixture of experts: a stacked-experts tensor becomes one ref per
    expert; q/k rows un-permuted for Mixtral only (qwen files keep Hugging Face's order)."""
    assert config.moe is not None
    arch = str(reader.fields["general.architecture"].contents())
    for t in reader.tensors:
        names = [(_GLOBAL_NAMES[t.name], None)] if t.name in _GLOBAL_NAMES else gguf_moe.hf_names(
            t.name, arch, config.moe.num_experts)
        if not names:
            raise TreadleError(f"{path}: tensor {t.name!r} has no place in a {config.architecture} model")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise TreadleError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        for hf_name, expert in names:
            rope_heads = None
            if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                rope_heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
            part = shape[1:] if expert is not None else (1, *shape) if hf_name.endswith("shared_expert_gate.weight") else shape
            yield GGUFTensorRef(hf_name, t, part, rope_heads, expert=expert)


def dequantize_ref(ref: GGUFTensorRef) -> torch.Tensor:
    """The ref's tensor as float32 in HF layout (q/k rows in rotate-half order)."""
    t = ref.tensor
    data = t.data if ref.expert is None else t.data[ref.expert]
    if t.tensor_type == GGMLQuantizationType.F32:
        array = np.array(data, dtype=np.float32)  # copy out of the memory map
    else:  # F16, BF16 and the block types -> a new float32 array
        array = dequantize(data, t.tensor_type)
    tensor = torch.from_numpy(array)
    tensor = tensor.reshape(ref.shape)
    if ref.rope_heads is not None:
        tensor = interleaved_to_rotate_half(tensor, ref.rope_heads)
    return tensor - ref.shift if ref.shift else tensor


def raw_blocks(ref: GGUFTensorRef) -> GGUFBlocks:
    """The ref's quantized rows, copied out of the memory map without dequantizing."""
    t = ref.tensor
    rows = t.data if ref.expert is None else t.data[ref.expert]
    data = torch.from_numpy(np.array(rows, dtype=np.uint8)).reshape(ref.shape[0], -1)
    if ref.rope_heads is not None:
        data = interleaved_to_rotate_half(data, ref.rope_heads)
    return GGUFBlocks(t.tensor_type.name, data, (ref.shape[0], ref.shape[1]))


def _check_extents(refs: list[GGUFTensorRef], path: Path) -> None:
    """Reject a file whose tensors extend past its end (truncated downloads)."""
    size = path.stat().st_size
    for ref in refs:
        t = ref.tensor
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise TreadleError(f"{path}: tensor {t.name!r} extends past the end of the file (truncated?)")


def open_gguf(path: str | Path, skip_tokenizer_init: bool = False) -> ModelSource:
    path = Path(path)
    reader = open_gguf_reader(path)
    try:
        md = read_metadata(reader)
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise TreadleError(f"{path}: unreadable GGUF metadata ({e})") from None
    config = gguf_model_config(md, {t.name for t in reader.tensors}, path)
    if config.architecture == "Gemma3ForCausalLM" and "tokenizer.chat_template" not in md:
        md["tokenizer.chat_template"] = gguf_gemma3.CHAT_TEMPLATE
    refs = list(gguf_tensor_refs(reader, config, path))
    _check_extents(refs, path)
    check_tensors(path, {ref.hf_name: ref.shape for ref in refs}, config)
    try:
        tokenizer = None if skip_tokenizer_init else Tokenizer.from_gguf_metadata(
            md, extra_eos_token_ids=config.eos_token_ids)
    except TreadleError as e:
        raise TreadleError(f"{path}: {e}") from None

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for ref in refs:
            yield ref.hf_name, dequantize_ref(ref)
        release_pages(reader)

    def raw_weights(keep_raw: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        for ref in refs:
            yield ref.hf_name, raw_blocks(ref) if keep_raw(ref.hf_name) else dequantize_ref(ref)
        release_pages(reader)

    tensor_types = {ref.hf_name: (ref.tensor.tensor_type.name, ref.shape) for ref in refs}
    return ModelSource(
        path=path, config=config, weights=weights, tokenizer=tokenizer, tensor_types=tensor_types, raw_weights=raw_weights
    )
