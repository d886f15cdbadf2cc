"""CompileProbe: a structured-output spec that may compile slowly is compiled first in a small
child process, under a time budget, so that one pathological schema cannot hold the server
(issue 34); every other spec is compiled once, by the engine, where it is used.

xgrammar compiles in C++ and cannot be interrupted in a thread; its compile time grows
steeply with a schema's optional properties (3.7 s at 1,000, 35 s at 2,000). So ``check``
first builds the spec's grammar (xgrammar's Grammar, no token masks: milliseconds even at
2,000 properties), which also finds a bad spec. A small grammar (few characters and counted
repetitions, ``{m,n}``, scaled by the vocabulary: see DIRECT_CHARS) compiles in under a second
(measured families in docs/serving.md): it is not compiled here, the engine compiles it once.
A larger one goes to the child (probe_child.py, started on first use, kept for the next spec),
which compiles it and answers ok or the error; past ``max_seconds`` it is killed (a new one
starts on the next spec) and the spec is refused naming ``--max-grammar-compile-s``. Its grammar is not sent back (it serializes to hundreds of MB, and
takes 20x longer to serialize than to compile), so for these specs the engine compiles it again,
knowing it finishes within the budget. Specs that passed are remembered (LRU), so a repeated
schema costs nothing here.

The wire is in probe_child.py. The budget counts from the spec's sending: the child's own
start-up (importing xgrammar, reading the vocabulary) is not charged to a request.
"""
from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

from treadle.config import InvalidRequestError
from treadle.sampling_params import STRUCTURED_PARAM, StructuredOutputsParams
from treadle.structured.probe_child import build, error
from treadle.structured.probe_child import read as _read
from treadle.structured.probe_child import write as _write

_REMEMBERED = 1024
_CHILD = str(Path(__file__).with_name("probe_child.py"))
START_TIMEOUT_S = 120.0  # the child's start-up (a loaded machine)
# A grammar compiles directly in the engine (no child) when, scaled by its vocabulary's size over
# SmolLM2's, it has at most DIRECT_CHARS characters (115 optional properties: 0.06-0.1 s) and its
# repetition counts multiply to at most DIRECT_REPEATS (regex [^"]{0,16}: 0.23 s; 0.83 s with
# Gemma 3's 262k vocabulary, where the scaled limit is 3).
DIRECT_CHARS = 16_000
DIRECT_REPEATS = 16
REFERENCE_VOCAB = 49_152
_REPEAT = re.compile(r"\{(\d+)(?:,\s*(\d*))?\}")  # {n}, {m,n}, {m,} in xgrammar's EBNF


def spec_text(spec: StructuredOutputsParams) -> str:
    """The text a spec's size is measured by: its schema, regex, grammar or choices."""
    kind = spec.kind
    if kind == "choice":
        return json.dumps(list(spec.choice or []))
    return "" if kind == "json_object" else str(getattr(spec, kind))


def repeats(ebnf: str) -> int:
    """The product of a grammar's repetition counts (the upper bound, else the lower), capped
    just above DIRECT_REPEATS. A counted repetition compiles like that many copies, so a tiny spec
    can take minutes: regex [^"]{0,256} 3.9 s, a JSON schema of 59 bytes whose pattern is
    ^([a-z]{1,30}\\s?){1,100}$ 316 s. Nesting multiplies; independent counts are multiplied too,
    which only sends more specs to the probe."""
    product = 1
    for low, high in _REPEAT.findall(ebnf):
        product *= max(1, int(high or low))
        if product > DIRECT_REPEATS:
            break
    return product


_NONE = object()  # no answer


class CompileProbe:
    def __init__(self, tokenizer_info_json: str, max_seconds: float, max_bytes: int | None = None,
                 vocab_size: int = REFERENCE_VOCAB, direct_chars: int = DIRECT_CHARS) -> None:
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        scale = max(1.0, vocab_size / REFERENCE_VOCAB)  # a compile's cost grows with the vocabulary
        self.direct_chars = int(direct_chars / scale)
        self.direct_repeats = int(DIRECT_REPEATS / scale)
        self.compiles = 0  # specs compiled in a child (a test counts them)
        # the vocabulary goes by file: MBs down a pipe would block until the child has started
        self._info_file = tempfile.NamedTemporaryFile("w", prefix="treadle-vocab-", suffix=".json")
        self._info_file.write(tokenizer_info_json)
        self._info_file.flush()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the child has said "ready"
        self._lock = threading.Lock()
        self._passed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._closed = False
        atexit.register(self.close)

    def check(self, spec: StructuredOutputsParams, left: threading.Event | None = None) -> None:
        """Return when ``spec`` is small (the engine compiles it, once) or compiles within the
        budget in the child; otherwise an InvalidRequestError naming the limit it broke, or
        xgrammar's complaint about the spec. ``left``: set when the client has gone (its
        compile is then killed)."""
        size = len(spec_text(spec).encode())
        if self.max_bytes is not None and size > self.max_bytes:
            raise InvalidRequestError(f"the structured-output spec has {size} bytes, more than the server's limit "
                                      f"of {self.max_bytes} (--max-grammar-bytes)", STRUCTURED_PARAM)
        key = spec.key
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return
        if self._small(spec):
            return
        with self._lock:
            refusal = "the client left" if left is not None and left.is_set() else self._compile(spec, left)
            if refusal is None:
                self._passed[key] = None
                while len(self._passed) > _REMEMBERED:
                    self._passed.popitem(last=False)
        if refusal is not None:
            raise InvalidRequestError(refusal, STRUCTURED_PARAM)

    def _small(self, spec: StructuredOutputsParams) -> bool:
        """Whether the spec's grammar is small enough to skip the child; a bad spec is an
        InvalidRequestError worded as the engine's compiler words it."""
        import xgrammar as xgr

        kind = spec.kind
        try:
            grammar = build(xgr, kind, spec_text(spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            raise InvalidRequestError(error(kind, e), STRUCTURED_PARAM) from None
        ebnf = str(grammar)
        return len(ebnf) <= self.direct_chars and repeats(ebnf) <= self.direct_repeats

    def _compile(self, spec: StructuredOutputsParams, left: threading.Event | None) -> str | None:
        """In the child, under the lock: None (compiled) or the error message."""
        proc = self._child()
        if proc is None:
            return "the server is shutting down" if self._closed else "the grammar compiler process did not start"
        assert proc.stdin is not None
        self.compiles += 1
        _write(proc.stdin, [spec.kind, spec_text(spec)])
        answer = self._answer(proc, self.max_seconds, left)
        if answer is not _NONE:
            return None if answer is None else str(answer)
        if self._closed:
            return "the server is shutting down"
        self._spawn()  # the next spec finds a child started (start-up is seconds: xgrammar imports torch)
        if left is not None and left.is_set():
            return "the client left"
        return (f"the structured-output spec did not compile within the server's limit of {self.max_seconds:g} s "
                "(--max-grammar-compile-s); simplify the schema (fewer optional properties)")

    def _answer(self, proc: subprocess.Popen[bytes], seconds: float, gone: threading.Event | None = None) -> object:
        """The child's next frame, or _NONE (the child is then killed) when it does not come
        within ``seconds``, the child dies, the probe is closed or ``gone`` is set."""
        assert proc.stdout is not None
        deadline = time.monotonic() + seconds
        while not self._closed and not (gone is not None and gone.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.1))
            if ready:
                try:
                    return _read(proc.stdout)
                except (EOFError, ValueError):
                    break
        self._kill()
        return _NONE

    def _child(self) -> subprocess.Popen[bytes] | None:
        """The running child, started (and waited for) when there is none; None if it fails."""
        if self._proc is not None and self._ready and self._proc.poll() is None:
            return self._proc
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._spawn()
        if proc is None:
            return None
        self._ready = self._answer(proc, START_TIMEOUT_S) == "ready"
        return proc if self._ready else None

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        """Start a child (it says "ready" when it can compile); None when closed."""
        if self._closed:
            return None
        self._proc = subprocess.Popen([sys.executable, _CHILD, self._info_file.name], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._ready = False
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def close(self) -> None:
        """Stop the child now (a compile in progress is abandoned and its request refused)."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        self._info_file.close()
