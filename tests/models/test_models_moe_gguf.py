"""GGUF mixtures of experts written as llama.cpp's converter lays them out (stacked
``ffn_*_exps``, router ``ffn_gate_inp``, Qwen2-MoE's ``ffn_*_shexp`` and its gate vector, Mixtral
as ``llama`` with ``expert_count`` and permuted q/k rows) load to the transformers model they
were written from: float32 tensors, token-identical greedy output and logits within 1e-4."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from gguf_files import finish, to_interleaved, write_shape
from paged_session import PagedSession, greedy
from test_models_moe import PROMPTS, make_moe_model

from treadle.layers.attention import ReferenceBackend
from treadle.loaders import load_model
from treadle.loaders.gguf import open_gguf

pytestmark = pytest.mark.usefixtures("one_thread")

_ATTN = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}


def write_moe_gguf(hf: torch.nn.Module, variant: str, path: Path, qtype: GGMLQuantizationType | None = None) -> Path:
    """``qtype``: the decoder layers' matrices (stacked experts too) quantized to it, else float32."""
    cfg, arch = hf.config, _ARCH[variant]
    w = GGUFWriter(path, arch)
    write_shape(w, cfg, float(cfg.rope_parameters["rope_theta"]))
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    moe = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(moe)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def add(name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if qtype is None or array.ndim < 2 or array.shape[-1] % 32:  # as llama.cpp: such rows stay float
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, array in state.items():
        if name in top:
            w.add_tensor(top[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if rest.endswith("experts.gate_up_proj"):  # transformers holds the experts stacked too
            gate, up = np.split(array, 2, axis=1)  # [E, 2I, hidden] -> gate, up [E, I, hidden]
            add(f"blk.{layer}.ffn_gate_exps.weight", gate)
            add(f"blk.{layer}.ffn_up_exps.weight", up)
            continue
        if rest.endswith("experts.down_proj"):  # [E, hidden, I]
            add(f"blk.{layer}.ffn_down_exps.weight", array)
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
            array = to_interleaved(array, heads)
        if module == "mlp.shared_expert_gate":
            array = array.reshape(-1)  # llama.cpp stores the gate as a [hidden] vector
        add(f"blk.{layer}.{_ATTN[module]}.{suffix}", array)
    return finish(w, path)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_gguf_moe_matches_transformers(tmp_path: Path, variant: str) -> None:
    hf = make_moe_model(tmp_path / "hf", variant)
    path = write_moe_gguf(hf, variant, tmp_path / "m.gguf")
    source = open_gguf(path, skip_tokenizer_init=True)
    assert source.config.architecture == type(hf).__name__
    lm = load_model(source, ReferenceBackend())
    logits = PagedSession(lm, 1, 40).feed([PROMPTS[1]])[0]
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([PROMPTS[1]])).logits[0], atol=1e-4, rtol=1e-4)
    for prompt, tokens in zip(PROMPTS, greedy(lm, PROMPTS, 16)):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want


@pytest.mark.usefixtures("sixteen_bit_activations")  # its tolerance is the 16-bit rounding's
@pytest.mark.parametrize(("variant", "qtype"), [("mixtral", "Q8_0"), ("qwen2-moe", "Q4_0")])
def test_gguf_block_experts_run_on_the_c_kernels(tmp_path: Path, variant: str, qtype: str) -> None:
    """Quantized experts stay in the file's blocks (uint8, multiplied by qmatmul) and give the
    dequantized model's logits within the 16-bit activation rounding, and its greedy tokens.
    (Not on the repeated-token prompt: there a router near-tie in Mixtral's layer 1 flips one
    token's second expert under that rounding -- a route, not an arithmetic, difference.)"""
    hf = make_moe_model(tmp_path / "hf", variant)
    path = write_moe_gguf(hf, variant, tmp_path / "m.gguf", GGMLQuantizationType[qtype])
    native_lm = load_model(open_gguf(path, skip_tokenizer_init=True), ReferenceBackend(), quantization="gguf")
    float_lm = load_model(open_gguf(path, skip_tokenizer_init=True), ReferenceBackend(), quantization="none")
    experts = next(layer.mlp.experts for layer in native_lm.model.layers if hasattr(layer.mlp, "experts"))
    assert experts.block_types == (qtype,) * 3 and experts.w13.dtype == torch.uint8
    got = PagedSession(native_lm, 1, 40).feed([PROMPTS[1]])[0]
    want = PagedSession(float_lm, 1, 40).feed([PROMPTS[1]])[0]
    torch.testing.assert_close(got, want, atol=1e-2, rtol=0)
    assert greedy(native_lm, PROMPTS[:2], 12) == greedy(float_lm, PROMPTS[:2], 12)
