"""The child process of CompileProbe (probe.py), run by path so that it imports xgrammar and
nothing of treadle's (whose package import brings in torch: seconds of start-up).

``probe_child.py VOCAB_FILE`` (xgrammar's serialized TokenizerInfo). stdin/stdout: frames of a
4-byte big-endian length and UTF-8 JSON. In: one ``[kind, text]`` per spec. Out: ``"ready"`` once the compiler is built,
then per spec ``null`` (it compiled) or the error, worded as GrammarCompiler words it.
"""
from __future__ import annotations

import json
import re
import struct
import sys
from typing import IO, Any

NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /src/x.cc:12: "


def write(stream: IO[bytes], obj: Any) -> None:
    data = json.dumps(obj).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def read(stream: IO[bytes]) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    (n,) = struct.unpack(">I", head)
    return json.loads(stream.read(n))


def reason(e: Exception) -> str:
    """xgrammar's message, first line, without its C++ source location."""
    lines = str(e).strip().splitlines()
    return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build(xgr: Any, kind: str, text: str) -> Any:
    """xgrammar's Grammar of a spec (milliseconds: the token masks are not computed yet);
    raises what xgrammar or json raises for a bad spec (see ``error``)."""
    if kind == "json":
        json.loads(text)
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


def error(kind: str, e: Exception) -> str:
    """A bad spec's message, worded as GrammarCompiler words it."""
    if isinstance(e, json.JSONDecodeError):
        return f"the JSON schema is not valid JSON: {e}"
    return f"invalid {NAMES.get(kind, kind)} for structured output: {reason(e)}"


def compile_one(compiler: Any, kind: str, text: str) -> str | None:
    import xgrammar as xgr

    try:
        compiler.compile_grammar(build(xgr, kind, text))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
        return error(kind, e)
    return None


def main() -> None:
    import xgrammar as xgr

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    with open(sys.argv[1]) as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write(out, "ready")
    while True:
        try:
            kind, text = read(inp)
        except EOFError:
            return
        write(out, compile_one(compiler, kind, text))


if __name__ == "__main__":
    main()
