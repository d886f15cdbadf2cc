"""`treadle router`: one OpenAI-compatible front for many instances (see treadle/router)."""
from __future__ import annotations

import argparse
import logging

from treadle.config import TreadleError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="route requests over several instances (P/D disaggregated or colocated)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (kv_producer)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (kv_consumer)")
    p.add_argument("--backend", nargs="+", default=[], metavar="URL",
                   help="plain colocated instances (instead of --prefill/--decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between health/load checks")
    p.add_argument("--upstream-timeout", type=float, default=300.0,
                   help="seconds to wait for an instance's answer (or its next streamed event)")
    p.add_argument("--max-attempts", type=int, default=3, help="instances tried per step of a request")
    p.add_argument("--max-failures", type=int, default=5,
                   help="consecutive failures (failed health checks or connections, one per back-off) that take an "
                        "instance out of rotation; until then the last instance of a role is retried")
    p.add_argument("--retry-backoff", type=float, default=1.0,
                   help="seconds a failing instance is left alone after its first failure, doubled after each")
    p.add_argument("--no-prefix-affinity", dest="prefix_affinity", action="store_false",
                   help="route by load only, ignoring which instance has a prompt's prefix cached")
    p.add_argument("--balance", choices=("cost", "count"), default="cost",
                   help="cost: by each instance's predicted remaining tokens (/load, where it reports them); "
                        "count: by running + waiting requests")
    p.add_argument("--queue", choices=("off", "fcfs", "predicted"), default="off",
                   help="hold requests in the router until an instance has a free batch slot (its max_num_seqs) and "
                        "release them in arrival order (fcfs) or shortest predicted job first (predicted: the "
                        "instances' length predictor through /tokenize, with the aging bounds below); off: send at once")
    p.add_argument("--queue-aging-s", type=float, default=120.0,
                   help="--queue predicted: no request is passed over by one that arrived this many seconds later")
    p.add_argument("--queue-max-passed-over", type=int, default=None,
                   help="--queue predicted: a request passed over this many times goes first (default: 20 per "
                        "generating instance, as many passes per instance as one engine's own default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from treadle.router.app import build_app
    from treadle.router.config import RouterConfig
    from treadle.server.connections import uvicorn_config

    if not 0 <= args.port <= 65535:
        raise TreadleError(f"--port {args.port} is not a TCP port (0-65535)")
    bad = [u for u in [*args.prefill, *args.decode, *args.backend] if not u.startswith(("http://", "https://"))]
    if bad:
        raise TreadleError(f"instance URLs must start with http:// or https:// (got {bad[0]!r})")
    try:
        config = RouterConfig(tuple(args.prefill), tuple(args.decode), tuple(args.backend),
                              poll_interval_s=args.poll_interval, upstream_timeout_s=args.upstream_timeout,
                              max_attempts=args.max_attempts, max_failures=args.max_failures,
                              retry_backoff_s=args.retry_backoff, prefix_affinity=args.prefix_affinity,
                              balance_by_cost=args.balance == "cost", queue=args.queue,
                              queue_aging_s=args.queue_aging_s, queue_max_passed_over=args.queue_max_passed_over)
    except ValueError as e:
        raise TreadleError(str(e)) from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("treadle").setLevel(args.log_level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream call and health check
    print(f"Treadle router at http://{args.host}:{args.port}/v1 over {len(config.instances())} instance(s)", flush=True)
    # the server's connection hygiene (header-read timeout, idle cap per address) at its defaults
    uvicorn.Server(uvicorn_config(build_app(config), host=args.host, port=args.port, log_level=args.log_level,
                                  timeout_graceful_shutdown=1, access_log=args.log_level == "debug")).run()
    return 0
