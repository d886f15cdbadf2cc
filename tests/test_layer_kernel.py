"""The one-call decoder layer (treadle/kernels/csrc/layer.c) on all-decode CPU steps gives
exactly what the module path gives (the same kernels one by one), on tiny GGUF-block models
of each architecture: GQA, Qwen2's qkv bias, Mistral's sliding window."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from paged_session import PagedSession

from treadle.kernels import layer as layer_kernel
from treadle.kernels import native
from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import LoadedModel, open_model_source
from treadle.models.llama import LlamaForCausalLM
from treadle.quantization.gguf_native import GGUFBlockMethod, GGUFBlocks

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
]

FLOAT = ("model.embed_tokens", "lm_head")


def gguf_block_model(path: Path, qtype: str) -> LoadedModel:
    """The checkpoint with every linear layer quantized to GGUF blocks (embedding float)."""
    src = open_model_source(str(path))
    model = LlamaForCausalLM(src.config, CPUBackend(), torch.float32,
                             method=lambda name: None if name in FLOAT else GGUFBlockMethod(qtype))

    def weights():  # noqa: ANN202
        for name, t in src.weights():
            if t.dim() == 2 and not name.startswith(("model.embed_tokens", "lm_head")):
                data = gguf_quantize(t.numpy(), GGMLQuantizationType[qtype])
                yield name, GGUFBlocks(qtype, torch.from_numpy(data), tuple(t.shape))
            else:
                yield name, t

    model.load_weights(weights())
    model.process_weights_after_loading()
    return LoadedModel(model.eval(), src.config, src.tokenizer, path)


def decode_logits(lm: LoadedModel, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    session = PagedSession(lm, len(prompts), max(map(len, prompts)) + steps, block_size=4)
    rows = session.feed(prompts)
    out = []
    for _ in range(steps):
        nxt = [[int(r[-1].argmax())] for r in rows]
        rows = session.feed(nxt)
        out.append(torch.stack([r[-1] for r in rows]))
    return out


@pytest.mark.parametrize(
    "arch,qtype,overrides",
    [
        ("llama", "Q4_1", {}),
        ("qwen2", "Q8_0", {}),
        ("mistral", "Q4_0", {"sliding_window": 6}),
    ],
)
def test_one_call_layer_equals_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                           qtype: str, overrides: dict) -> None:
    path = make_tiny_model(tmp_path / arch, arch, seed=3, hidden_size=64, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, **overrides)
    lm = gguf_block_model(path, qtype)
    prompts = [[5, 9, 13, 2, 7], [3] * 11, [8, 4]]
    calls = []
    run = layer_kernel.DecodeStep.run
    monkeypatch.setattr(layer_kernel.DecodeStep, "run", lambda self, *a: (calls.append(1), run(self, *a))[1])
    fused = decode_logits(lm, prompts, 9)
    assert len(calls) == 9 * lm.config.num_layers  # every decode step, every layer
    lm.model._one_call_layers = False  # the module path, kernel by kernel
    modules = decode_logits(lm, prompts, 9)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)
