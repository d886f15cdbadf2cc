"""skip_tokenizer_init: a checkpoint with no tokenizer serves token ids in and out."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from server_harness import serve

from treadle.config import TreadleError
from treadle.entrypoints.llm import LLM
from treadle.loaders.resolve import resolve_model
from treadle.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
KW = dict(num_kv_blocks=64, max_model_len=256)
PROMPT = [1, 403, 407, 261, 378, 284]


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260k without its tokenizer files."""
    dest = tmp_path_factory.mktemp("bare") / "stories"
    shutil.copytree(resolve_model("stories260k"), dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).unlink()
    return dest


def test_missing_tokenizer_names_both_ways_out(bare_model: Path) -> None:
    with pytest.raises(TreadleError, match="tokenizer.json nor tokenizer.model.*skip_tokenizer_init"):
        LLM(str(bare_model), **KW)


def test_token_ids_in_and_out_match_the_tokenized_engine(bare_model: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref = LLM("stories260k", **KW).generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    llm = LLM(str(bare_model), skip_tokenizer_init=True, **KW)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.outputs[0].text == ""
    with pytest.raises(TreadleError, match="skip_tokenizer_init.*token ids"):
        llm.generate(["Once upon a time"], params, use_tqdm=False)
    with pytest.raises(TreadleError, match="stop string"):
        llm.generate([PROMPT], SamplingParams(stop=["."]), use_tqdm=False)


@pytest.mark.server
def test_server_completions_with_token_ids(bare_model: Path) -> None:
    with serve(bare_model, engine_kw={"skip_tokenizer_init": True}) as (srv, _):
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Once", "max_tokens": 5}, timeout=60)
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
