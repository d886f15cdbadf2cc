"""The `treadle` command: each subcommand lives in its own module exposing
``register(subparsers)``, which adds its parser and sets ``func``."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from treadle.config import TreadleError

# the module of each subcommand: a bare name is under treadle.entrypoints; a package that owns its
# whole verb (bench) is named in full
_SUBCOMMANDS: list[str] = ["generate", "convert", "treadle.bench.cli", "serve", "router",
                          "train_draft_head", "train_length_predictor", "quantize", "eval", "doctor"]


class _Version(argparse.Action):
    """``--version``: the package version and the CPU kernel variant this machine runs (built,
    or found in the cache, only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and the CPU kernels, then exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from treadle import __version__
        from treadle.kernels import native

        try:
            print(f"treadle {__version__}\ncpu kernels: {native.describe()}")
        except TreadleError as e:
            parser.exit(2, f"error: {e}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description="Treadle LLM inference engine")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(name if "." in name else f"treadle.entrypoints.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except TreadleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
