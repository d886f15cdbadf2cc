"""The API process of `treadle serve` (default: the engine in its own process) imports no torch:
the app, the multi-process engine client and the CLI up to the engine's start are checked in a
fresh interpreter; the tokenizer the engine sends in ``Ready`` arrives whole."""
from __future__ import annotations

import os
import subprocess
import sys

from treadle.config import ModelConfig
from treadle.engine.core.messages import EngineSnapshot, Ready, encoder, from_core_decoder
from treadle.loaders import open_model_source
from treadle.tokenizer import Tokenizer
from treadle.vocab import sentencepiece_bpe

# what `treadle serve stories260k` runs before it starts the engine process, and the modules that
# start it and serve requests; the engine client is a stub (starting a real one takes seconds)
API_PROCESS = """
import sys
from treadle.entrypoints import serve
from treadle.entrypoints.cli import build_parser
from treadle.engine.client.engine_client import EngineClient
from treadle.engine.client.multi_process import EngineCoreClient
from treadle.engine.core.messages import EngineSnapshot
from treadle.engine.core.process import engine_from_args, run_engine_core
from treadle.server.app import build_app
from treadle.server.connections import uvicorn_config
from treadle.server.lifecycle import DrainingServer
from treadle.server.structured import structured_request
from treadle.server.tools import *  # noqa: F403

class Stub(EngineClient):
    tokenizer, max_model_len, max_num_seqs, length_predictor = None, 512, 8, None
    heartbeat_timeout, snapshot, dead_error, num_open_requests = 60.0, EngineSnapshot(), None, 0
    async def admit(self, *args): pass
    def abort(self, request_ids): pass
    def is_alive(self): return True
    def heartbeat_age(self): return 0.0
    def shutdown(self, timeout=10.0): pass
    def compile_grammar(self, spec): pass

args = build_parser().parse_args(["serve", "stories260k", "--port", "0"])
assert args.func is serve.run_serve
app = build_app(Stub(), "stories260k", limits=serve._limits(args))
config = uvicorn_config(app, args.header_timeout, args.max_idle_connections_per_client, port=0)
DrainingServer(config, app.state.treadle, args.shutdown_timeout)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def _run(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_api_process_imports_no_torch() -> None:
    assert _run(API_PROCESS) == "[]"


def _round_trip(tok: Tokenizer) -> Tokenizer:
    """Through the Ready message, as the API process receives it."""
    cfg = ModelConfig("LlamaForCausalLM", 512, 64, 172, 5, 8, 4, 8, 1e-5, 1e4, 512, True, eos_token_ids=(2, 1))
    msg = from_core_decoder().decode(encoder().encode(Ready(512, EngineSnapshot(), cfg, 8, None, tok.to_dict())))
    assert isinstance(msg, Ready) and msg.model_config == cfg and msg.tokenizer is not None
    return Tokenizer.from_dict(msg.tokenizer)


def _assert_same(a: Tokenizer, b: Tokenizer) -> None:
    for attr in ("bos_token", "eos_token", "bos_token_id", "eos_token_ids", "chat_template", "vocab_size",
                 "all_special_ids"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for text in ("Once upon a time", " two  spaces\n\nand <s> specials </s>", "ünïcödé 🙂"):
        for special in (True, False):
            assert a.encode(text, special) == b.encode(text, special)
        assert a.decode(a.encode(text), False) == b.decode(b.encode(text), False)


def test_tokenizer_travels_in_ready() -> None:
    """The engine's tokenizer reaches the API process whole: a Hugging Face directory's, and a
    GGUF-style SentencePiece vocabulary whose BOS rule lives in the post-processor."""
    hf = open_model_source("stories260k").tokenizer
    assert hf is not None
    _assert_same(hf, _round_trip(hf))
    pieces = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"]
    backend = sentencepiece_bpe(pieces, [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.6, -0.1], [2, 3, 3, 1, 1, 1, 1, 1, 1],
                                0, True)
    gguf = Tokenizer(backend, "<s>", "</s>", "{{ messages }}", add_bos_token=True, extra_eos_token_ids=[1])
    _assert_same(gguf, _round_trip(gguf))
