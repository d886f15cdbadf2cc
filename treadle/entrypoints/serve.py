"""`treadle serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

By default the engine's step loop runs in its own process (``EngineCoreClient``), so
HTTP, tokenization and the step loop never contend for one GIL, and the server process
imports no torch (it starts faster and stays small); ``--engine-in-process`` keeps the
engine in a thread of the server process (``AsyncLLM``).
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from treadle import envs
from treadle.engine.cli_args import add_engine_args, engine_kwargs, positive_int

if TYPE_CHECKING:
    from treadle.engine.client.engine_client import EngineClient
    from treadle.engine.llm_engine import LLMEngine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model argument)")
    p.add_argument("--api-key", default=envs.api_key(),
                   help="require 'Authorization: Bearer KEY' (default: $TREADLE_API_KEY; none: open)")
    p.add_argument("--max-waiting", type=positive_int, default=None,
                   help="refuse new requests with 503 + Retry-After while this many sequences wait")
    p.add_argument("--max-seqs-per-request", type=positive_int, default=None,
                   help="refuse (400) a request whose prompts x n exceeds this")
    p.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help="refuse (413) larger request bodies (default: from max_model_len, at least 1 MiB)")
    p.add_argument("--max-logprob-entries", type=positive_int, default=None,
                   help="refuse (400) a request that could produce more logprob entries than this "
                        "(prompts x n x max_tokens x (logprobs+1), plus prompt logprobs; default 500,000)")
    p.add_argument("--stream-stall-timeout", type=float, default=None,
                   help="abort a streamed request whose client has read nothing for this many seconds (default 30)")
    p.add_argument("--max-grammar-compile-s", type=float, default=None,
                   help="refuse (400) a structured-output spec that does not compile within this many seconds "
                        "(compiled in a child process, killed at the deadline; default 10)")
    p.add_argument("--max-grammar-bytes", type=positive_int, default=None,
                   help="refuse (400) a structured-output schema, regex or grammar larger than this (default 65536)")
    p.add_argument("--header-timeout", type=float, default=None,
                   help="close a connection whose request headers are not complete this many seconds after its "
                        "first byte (or after it opened; default 10)")
    p.add_argument("--max-idle-connections-per-client", type=positive_int, default=None,
                   help="keep at most this many idle connections per client address; beyond it the oldest "
                        "is closed (default 64)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's special tokens, chat template, ...), as vLLM")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0,
                   help="/health reports the engine stuck after this many seconds without a finished step")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine step loop in a thread of the server process (default: its own process)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def start_engine(args: argparse.Namespace, engine_factory: Callable[..., LLMEngine] | None = None
                 ) -> tuple[EngineClient, str]:
    """The engine client the flags ask for, and the model name. ``engine_factory(model,
    **engine_kwargs)`` builds the engine (default ``LLMEngine.from_args``; picklable, as
    it runs in the engine process). Without ``--threads`` an engine process gets one
    thread fewer than the cores, so the API process is not starved: OpenMP workers that
    lose their core stall every parallel region (measured on 2 cores: 66 vs 675 tok/s).
    Only ``--engine-in-process`` imports the engine (and torch) into this process."""
    kw = engine_kwargs(args)
    model = kw.pop("model")
    if args.engine_in_process:
        from treadle.engine.client.in_process import AsyncLLM
        from treadle.engine.llm_engine import LLMEngine

        return AsyncLLM((engine_factory or LLMEngine.from_args)(model, **kw), args.heartbeat_timeout), model
    from treadle.engine.client.multi_process import EngineCoreClient
    from treadle.engine.core.process import engine_from_args

    build = functools.partial(engine_factory or engine_from_args, model, **kw)
    return EngineCoreClient(build, args.heartbeat_timeout, args.threads, spare_threads=1), model


def run_serve(args: argparse.Namespace, engine_factory: Callable[..., LLMEngine] | None = None) -> int:
    from treadle.config import TreadleError
    from treadle.server.app import build_app
    from treadle.server.connections import uvicorn_config
    from treadle.server.lifecycle import DrainingServer

    if not 0 <= args.port <= 65535:  # checked before the model loads, as one line
        raise TreadleError(f"--port {args.port} is not a TCP port (0-65535)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("treadle").setLevel(args.log_level.upper())
    llm, model = start_engine(args, engine_factory)
    try:
        app = build_app(llm, served_model_name=args.served_model_name or model, api_key=args.api_key,
                        limits=_limits(args), enable_tokenizer_info=args.enable_tokenizer_info_endpoint)
        config = uvicorn_config(app, args.header_timeout, args.max_idle_connections_per_client, host=args.host,
                                port=args.port, log_level=args.log_level, timeout_graceful_shutdown=1,
                                access_log=args.log_level == "debug")
        DrainingServer(config, app.state.treadle, args.shutdown_timeout,
                       on_ready=lambda: _announce(args, app.state.treadle.served_model_name)).run()
    finally:
        llm.shutdown()
    return 0


def _limits(args: argparse.Namespace):  # noqa: ANN202 - ServerLimits, imported late (keeps --help fast)
    from treadle.server.state import ServerLimits

    given = {"max_waiting": args.max_waiting, "max_seqs_per_request": args.max_seqs_per_request,
             "max_request_bytes": args.max_request_bytes, "max_logprob_entries": args.max_logprob_entries,
             "stream_stall_timeout": args.stream_stall_timeout, "max_grammar_compile_s": args.max_grammar_compile_s,
             "max_grammar_bytes": args.max_grammar_bytes}
    return ServerLimits(**{k: v for k, v in given.items() if v is not None})


def _announce(args: argparse.Namespace, model: str) -> None:
    """Where the server is, and a request to try, once it accepts connections."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}"
    auth = ' -H "Authorization: Bearer $TREADLE_API_KEY"' if args.api_key else ""
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32})
    print(f"Treadle is serving {model} at {url}/v1  (health: {url}/health)\n"
          f"Try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'", flush=True)
