"""The draft-head file format (``treadle train-draft-head`` writes it, the eagle / medusa
proposers read it): a directory with

    config.json         {"format": "treadle-draft-head", "version": 1,
                         "method": "eagle" | "medusa",
                         "num_speculative_tokens": K,      # medusa: its number of heads;
                                                           # eagle: the chain length trained for
                         "target": {"name", "architecture", "hidden_size", "vocab_size",
                                    "num_layers"},         # the fingerprint of the target
                         "layer": {"intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "head_dim"}}   # eagle only
    model.safetensors   eagle:  fc.weight [H, 2H], fc.bias [H], and one Llama decoder layer
                                named as Hugging Face does (layers.0.self_attn.q_proj.weight ...,
                                layers.0.input_layernorm.weight ...)
                        medusa: heads.{k}.weight [H, H], heads.{k}.bias [H], k = 0 .. K-1
                        either, optional: draft_vocab [n] int32, the token ids the head was
                                trained over (a large vocabulary's label set): drafts are the
                                argmax over these lm_head rows only (a fraction of the cost)

A head reuses the target's embedding, final norm, lm_head and RoPE settings, so it holds none
of them. Loading checks the fingerprint's architecture, hidden size, vocabulary size and
layer count against the target (the name is informational: a renamed directory still loads);
a mismatch or a malformed directory is one TreadleError line.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from treadle.config import ModelConfig, TreadleError

FORMAT, VERSION = "treadle-draft-head", 1
HEAD_METHODS = ("eagle", "medusa")
DRAFT_VOCAB = "draft_vocab"  # optional tensor: token ids the drafts are chosen among


@dataclass(frozen=True)
class TargetFingerprint:
    name: str
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @staticmethod
    def of(cfg: ModelConfig, name: str) -> TargetFingerprint:
        return TargetFingerprint(name, cfg.architecture, cfg.hidden_size, cfg.vocab_size, cfg.num_layers)

    def mismatch(self, cfg: ModelConfig) -> str | None:
        """Why a head trained on this fingerprint cannot run on ``cfg``; None when it can."""
        theirs = TargetFingerprint.of(cfg, self.name)
        for key in ("architecture", "hidden_size", "vocab_size", "num_layers"):
            if getattr(self, key) != getattr(theirs, key):
                return f"{key} {getattr(self, key)} (trained on {self.name}) but the target has {getattr(theirs, key)}"
        return None


@dataclass(frozen=True)
class EagleLayerShape:
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @staticmethod
    def like(cfg: ModelConfig) -> EagleLayerShape:
        """The shape of one of the target's own decoder layers."""
        return EagleLayerShape(cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def eagle_layer_config(target: ModelConfig, shape: EagleLayerShape) -> ModelConfig:
    """The ModelConfig of the EAGLE layer (its KV cache is planned and allocated from it): the
    target's RoPE and norm settings, one layer of ``shape``, no bias, no sliding window."""
    return dataclasses.replace(
        target, num_layers=1, intermediate_size=shape.intermediate_size, num_heads=shape.num_attention_heads,
        num_kv_heads=shape.num_key_value_heads, head_dim=shape.head_dim, qkv_bias=False, sliding_window=None)


@dataclass(frozen=True)
class HeadConfig:
    method: str  # "eagle" | "medusa"
    num_speculative_tokens: int
    target: TargetFingerprint
    layer: EagleLayerShape | None = None  # eagle only

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION, "method": self.method,
                               "num_speculative_tokens": self.num_speculative_tokens, "target": asdict(self.target)}
        if self.layer is not None:
            out["layer"] = asdict(self.layer)
        return out

    @staticmethod
    def from_json(raw: Any, where: str) -> HeadConfig:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise TreadleError(f"{where}: not a draft head (config.json has no \"format\": \"{FORMAT}\")")
        if raw.get("version") != VERSION:
            raise TreadleError(f"{where}: draft-head format version {raw.get('version')!r}, expected {VERSION}")
        method = raw.get("method")
        if method not in HEAD_METHODS:
            raise TreadleError(f"{where}: draft-head method {method!r} is not one of {', '.join(HEAD_METHODS)}")
        try:
            target = TargetFingerprint(**raw["target"])
            layer = EagleLayerShape(**raw["layer"]) if method == "eagle" else None
            k = int(raw["num_speculative_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise TreadleError(f"{where}: malformed draft-head config.json ({type(e).__name__}: {e})") from None
        return HeadConfig(method, k, target, layer)


def save_head(out_dir: Path, config: HeadConfig, tensors: dict[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    save_file({k: v.detach().contiguous() if k == DRAFT_VOCAB else v.detach().contiguous().float()
               for k, v in tensors.items()}, str(out_dir / "model.safetensors"))


def read_head_config(head_dir: Path | str) -> HeadConfig:
    path = Path(head_dir)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TreadleError(f"draft head {path}: no config.json (expected a directory written by "
                           "`treadle train-draft-head`)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TreadleError(f"draft head {path}: config.json is not readable JSON ({e})") from None
    return HeadConfig.from_json(raw, f"draft head {path}")


def load_head(head_dir: Path | str, target: ModelConfig, method: str) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """The head's config and tensors (float32; ``draft_vocab`` int32), checked against the
    target and the method asked for."""
    path = Path(head_dir)
    config = read_head_config(path)
    if config.method != method:
        raise TreadleError(f"draft head {path} is a {config.method} head, not {method}")
    why = config.target.mismatch(target)
    if why is not None:
        raise TreadleError(f"draft head {path} does not fit this model: {why}")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise TreadleError(f"draft head {path}: no model.safetensors")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 (safetensors raises several types for a bad file)
        raise TreadleError(f"draft head {path}: model.safetensors is not readable ({e})") from None
    vocab = tensors.get(DRAFT_VOCAB)
    if vocab is not None and (vocab.dtype.is_floating_point or vocab.dim() != 1 or vocab.numel() == 0
                              or int(vocab.min()) < 0 or int(vocab.max()) >= target.vocab_size):
        raise TreadleError(f"draft head {path}: {DRAFT_VOCAB} must be a non-empty list of token ids "
                           f"below the vocabulary size {target.vocab_size}")
    return config, tensors
