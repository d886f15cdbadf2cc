"""`treadle quantize` (SmoothQuant, GPTQ, AWQ, RTN -> compressed-tensors) and
`treadle eval perplexity`, on tiny random Llamas and the bundled stories260k."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from treadle.calibrate.grid import Grid
from treadle.calibrate.spec import QuantizeSpec
from treadle.config import TreadleError
from treadle.entrypoints.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
CALIBRATION = Path(__file__).resolve().parents[2] / "treadle" / "assets" / "text" / "calibration.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # grouped-query attention (4 heads on 2 KV heads): the o_proj -> v_proj fold must tie scales per group
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", hidden_size=64, intermediate_size=128)


def _hf_float(path: Path) -> torch.nn.Module:
    from treadle.calibrate.hf_model import build_hf_model, hf_config_dict
    from treadle.loaders import open_model_source

    source = open_model_source(str(path))
    return build_hf_model(source, hf_config_dict(source))


def _calibration_inputs(model: torch.nn.Module, samples: int = 4, seq: int = 48):
    from treadle.calibrate.layers import first_layer_inputs

    batch = torch.randint(2, 200, (samples, seq), generator=torch.Generator().manual_seed(1))
    return batch, first_layer_inputs(model, batch)


@pytest.mark.parametrize("method", ["smoothquant", "awq"])
def test_smoothing_fold_leaves_float_outputs_unchanged(tiny: Path, method: str) -> None:
    from treadle.calibrate.awq import group_inputs, search_scales
    from treadle.calibrate.layers import SMOOTH_GROUPS, decoder_layers, run_layer
    from treadle.calibrate.smooth import fold_scales
    from treadle.calibrate.smoothquant import smooth_layer

    model = _hf_float(tiny)
    batch, inputs = _calibration_inputs(model)
    with torch.no_grad():
        before = model(input_ids=batch).logits
        for layer in decoder_layers(model):
            if method == "smoothquant":
                smooth_layer(layer, inputs, alpha=0.5)
            else:  # the scales AWQ searched, folded without quantizing afterwards
                xs = group_inputs(layer, inputs)
                for group in SMOOTH_GROUPS:
                    fold_scales(layer, group, search_scales(xs[group.linears[0]], layer, group, Grid(4, 32)))
            inputs = run_layer(layer, inputs)
        after = model(input_ids=batch).logits
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight, _hf_float(tiny).model.layers[0].self_attn.v_proj.weight)
    torch.testing.assert_close(after, before, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reduces_layer_output_error_against_rtn(tiny: Path, act_order: bool) -> None:
    from treadle.calibrate.gptq import HessianSum, gptq_quantize
    from treadle.calibrate.layers import decoder_layers, linear_inputs, run_layer

    model = _hf_float(tiny)
    _, inputs = _calibration_inputs(model, samples=8)
    layer = decoder_layers(model)[0]
    xs: dict[str, list[torch.Tensor]] = {"self_attn.q_proj": [], "mlp.down_proj": []}
    with linear_inputs(layer, list(xs), lambda n, x: xs[n].append(x)):
        run_layer(layer, inputs)
    grid = Grid(4, 32)
    for name, parts in xs.items():
        x, w = torch.cat(parts), layer.get_submodule(name).weight.data
        h = HessianSum(w.shape[1])
        h.add(x)
        q_gptq, s_gptq = gptq_quantize(w, h.h, grid, act_order=act_order)
        q_rtn, _ = grid.rtn(w)
        err = {k: float((x @ (q - w).T).pow(2).mean()) for k, q in (("gptq", q_gptq), ("rtn", q_rtn))}
        assert err["gptq"] < 0.8 * err["rtn"], (name, err)
        # on the grid: every weight is an integer in [-8, 7] times its group's scale
        codes = q_gptq.reshape(w.shape[0], -1, 32) / s_gptq.unsqueeze(-1)
        torch.testing.assert_close(codes, codes.round(), atol=1e-4, rtol=0)
        assert int(codes.round().min()) >= -8 and int(codes.round().max()) <= 7


@pytest.mark.parametrize(("method", "bits", "group_size", "fmt"), [
    ("smoothquant", 8, None, "int-quantized"),
    ("rtn", 8, None, "int-quantized"),
    ("gptq", 4, 32, "pack-quantized"),
    ("awq", 4, 32, "pack-quantized"),
    ("rtn", 4, 64, "pack-quantized"),
])
def test_quantize_writes_a_compressed_tensors_checkpoint_transformers_loads(
        tiny: Path, tmp_path: Path, method: str, bits: int, group_size: int | None, fmt: str) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / method
    args = ["quantize", str(tiny), str(out), "--method", method, "--bits", str(bits),
            "--calibration", str(CALIBRATION), "--num-samples", "4", "--seq-len", "64"]
    assert main(args + (["--group-size", str(group_size)] if group_size else [])) == 0
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == fmt
    group = qcfg["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == bits and group["weights"]["group_size"] == group_size
    assert (group["input_activations"] is not None) == (bits == 8)
    assert (out / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    stored = "weight_packed" if fmt == "pack-quantized" else "weight"
    assert f"model.layers.0.self_attn.q_proj.{stored}" in keys
    assert "model.layers.0.self_attn.q_proj.weight_scale" in keys

    # transformers decompresses exactly the weights the algorithm produced in memory
    from treadle.calibrate.calibration import calibration_batch
    from treadle.calibrate.pipeline import quantize_model
    from treadle.loaders import open_model_source

    spec = QuantizeSpec.build(method, bits, group_size, 0.8, 4, 64)
    expected = _hf_float(tiny)
    quantize_model(expected, calibration_batch(CALIBRATION, open_model_source(str(tiny)).tokenizer, 4, 64), spec)
    quant = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(run_compressed=False))
    got = dict(quant.eval().named_parameters())
    for name, want in expected.named_parameters():
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-5)
    ids = torch.randint(2, 200, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q_logits, f_logits = quant(ids).logits[0], _hf_float(tiny)(ids).logits[0]
    rel = float((q_logits - f_logits).norm() / f_logits.norm())
    assert 0 < rel < (0.1 if bits == 8 else 0.6), rel  # a random tiny model is chaotic: a loose bound


def test_quantize_bad_input_is_one_line(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tiny), str(tmp_path / "o"), "--method", "smoothquant", "--bits", "4",
                 "--calibration", str(CALIBRATION)]) == 2
    assert main(["quantize", str(tiny), str(tmp_path / "o"), "--method", "gptq"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: smoothquant writes W8A8: use --bits 8",
                   "error: --method gptq needs --calibration FILE (a text file)"]
    with pytest.raises(TreadleError, match="group-size 48"):
        QuantizeSpec.build("gptq", 4, 48, 0.8, 4, 64)


def test_perplexity_windows_score_every_token_once() -> None:
    from treadle.bench.perplexity import windows

    for n, w, s in ((10, 4, 2), (100, 32, 32), (5, 8, 4), (97, 16, 5)):
        scored = [p for _, end, first in windows(n, w, s) for p in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= w for begin, end, _ in windows(n, w, s))


def test_eval_perplexity_on_stories260k(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    text = tmp_path / "eval.txt"  # the bundled text's first 3,000 characters: ~1,700 tokens
    text.write_text((resources.files("treadle") / "assets/text/eval.txt").read_text()[:3000])
    args = ["eval", "perplexity", "stories260k", "--json", "--window", "128", "--stride", "64", "--text", str(text)]
    assert main(args) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["top1_agreement"] == 1.0 and same["mean_abs_dlogit"] == 0.0
    assert 1.0 < same["perplexity"] < 512 and same["tokens_scored"] > 1000
    assert main([*args, "--quantization", "int4-g32"]) == 0
    int4 = json.loads(capsys.readouterr().out)
    assert int4["tokens_scored"] == same["tokens_scored"]
    assert 0.5 < int4["top1_agreement"] < 1.0 and int4["mean_abs_dlogit"] > 0
    assert int4["perplexity"] != same["perplexity"] and int4["weight_mb"] < same["weight_mb"]
    assert main([*args, "--kv-cache-dtype", "int8"]) == 0
    kv8 = json.loads(capsys.readouterr().out)  # float weights, int8 cache, against the float cache
    assert kv8["tokens_scored"] == same["tokens_scored"] and kv8["weight_mb"] == same["weight_mb"]
    assert 0.9 < kv8["top1_agreement"] < 1.0 and 0 < kv8["mean_abs_dlogit"] < int4["mean_abs_dlogit"]


@pytest.mark.parametrize(("method", "bits"), [("smoothquant", 8), ("gptq", 4), ("awq", 4)])
@pytest.mark.usefixtures("sixteen_bit_activations")  # int4 layers run as Q4_1 blocks
def test_treadle_runs_our_checkpoints_like_transformers(tiny: Path, tmp_path: Path, method: str, bits: int) -> None:
    """Treadle's compressed-tensors loader (W8A8 int8 kernel, int4 path) on what we wrote:
    the same greedy tokens as transformers on the same checkpoint."""
    from paged_session import greedy
    from transformers import AutoModelForCausalLM

    from treadle.layers.attention.cpu import CPUBackend
    from treadle.loaders import load_model

    out = tmp_path / method
    group = ["--group-size", "32"] if bits == 4 else []
    assert main(["quantize", str(tiny), str(out), "--method", method, "--bits", str(bits), *group,
                 "--calibration", str(CALIBRATION), "--num-samples", "4", "--seq-len", "64"]) == 0
    prompts = [[5, 17, 99, 3, 42, 8], [120, 7, 7, 64]]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert greedy(load_model(str(out), CPUBackend()), prompts, 8) == want
