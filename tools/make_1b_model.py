"""Make the 1B-class benchmark model (issue 32 item 3): TinyLlama-1.1B's shape with seeded random
weights, converted to GGUF by llama.cpp's own convert_hf_to_gguf.py and quantized by its own
llama-quantize to Q4_K_M and Q4_0, so Treadle and llama.cpp read the very same files.

    .venv/bin/python tools/make_1b_model.py        # minutes once; then prints the folder at once

Needs the binaries and vendored sources of tools/build_llamacpp.sh (run first; this script calls it,
which is instant once built). Files (not committed), under ${TREADLE_CACHE_DIR:-~/.cache/treadle}/models/
tinyllama-shape-random-seed0/: hf/ (safetensors, float16), f16.gguf, Q4_K_M.gguf, Q4_0.gguf.
The last line printed is that folder.

The tokenizer is a SentencePiece BPE model written piece by piece: <unk> <s> </s>, the 256 byte
pieces (byte fallback), then "\u2581" (the space) and letter pieces up to the 32,000-token vocabulary: enough for text to
round-trip, and the vocabulary's size (the embedding and lm_head bytes) is TinyLlama's.
"""
from __future__ import annotations

import itertools
import json
import os
import string
import subprocess
import sys
from pathlib import Path

from treadle import envs

SHAPE = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
             intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SEED = 0
QUANTS = ("Q4_K_M", "Q4_0")
HERE = Path(__file__).resolve().parent


def out_dir() -> Path:
    cache = Path(envs.cache_dir())
    return cache / "models" / f"tinyllama-shape-random-seed{SEED}"


def llamacpp_bin() -> Path:
    run = subprocess.run(["bash", str(HERE / "build_llamacpp.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(run.stdout.strip().splitlines()[-1])


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from sentencepiece import sentencepiece_model_pb2 as sp

    proto = sp.ModelProto()
    proto.trainer_spec.model_type = sp.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = vocab_size
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    Piece = sp.ModelProto.SentencePiece
    for text, kind in (("<unk>", Piece.UNKNOWN), ("<s>", Piece.CONTROL), ("</s>", Piece.CONTROL)):
        proto.pieces.add(piece=text, score=0.0, type=kind)
    for b in range(256):
        proto.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=Piece.BYTE)
    letters = string.ascii_lowercase
    words = itertools.chain(("",), letters, string.ascii_uppercase, string.digits, string.punctuation,
                            ("".join(p) for p in itertools.product(letters, repeat=2)),
                            ("".join(p) for p in itertools.product(letters, repeat=3)))
    for rank, text in enumerate(w for word in words for w in ("\u2581" + word, word) if w):
        if len(proto.pieces) == vocab_size:
            break
        proto.pieces.add(piece=text, score=-float(rank), type=Piece.NORMAL)
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))


def make_hf(folder: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.float16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    write_tokenizer(tmp, SHAPE["vocab_size"])
    tmp.rename(folder)


def convert(hf: Path, bin_dir: Path, f16: Path) -> None:
    src = bin_dir.parent / "src"  # the vendored llama.cpp tree beside the binaries
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))  # the converter's own gguf-py
    tmp = f16.with_suffix(".tmp")
    subprocess.run(["nice", sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                    "--outfile", str(tmp)], check=True, env=env, cwd=src)
    tmp.rename(f16)


def quantize(bin_dir: Path, f16: Path, kind: str, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    threads = str(len(os.sched_getaffinity(0)))
    subprocess.run(["nice", str(bin_dir / "llama-quantize"), str(f16), str(tmp), kind, threads], check=True)
    tmp.rename(out)


def main() -> int:
    folder = out_dir()
    targets = [folder / f"{q}.gguf" for q in QUANTS]
    if all(t.is_file() for t in targets):
        print(folder)
        return 0
    bin_dir = llamacpp_bin()
    folder.mkdir(parents=True, exist_ok=True)
    hf, f16 = folder / "hf", folder / "f16.gguf"
    if not (hf / "config.json").is_file():
        print(f"writing random weights ({SHAPE}) to {hf} ...", file=sys.stderr)
        make_hf(hf)
    if not f16.is_file():
        convert(hf, bin_dir, f16)
    for kind, target in zip(QUANTS, targets):
        if not target.is_file():
            quantize(bin_dir, f16, kind, target)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
