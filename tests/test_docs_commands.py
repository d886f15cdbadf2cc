"""The short commands the docs show run as written: every Python block of README.md and
docs/*.md that needs no server, and every `treadle generate`, `treadle --version` and
`treadle doctor` line of their shell blocks. (Serving, benchmarking and multi-process
commands are exercised by their own tests; the archive of past benchmark passes is a
record, not instructions.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # runs the CLI and each example in a process of its own

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks-archive.md")]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
QUICK_VERBS = ("generate", "--version", "doctor")


def blocks(lang: str) -> list[tuple[str, str]]:
    """(page:line, code) of every fenced block in ``lang`` on the pages."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:
                out.append((f"{page.name}:{text[: m.start()].count(chr(10)) + 1}", m.group(2)))
    return out


def quick_commands() -> list[tuple[str, str]]:
    out = []
    for where, code in blocks("sh"):
        for line in code.splitlines():
            cmd = line.split("  #")[0].strip()
            words = cmd.split() if cmd.startswith("treadle ") and not cmd.endswith("\\") else []
            if len(words) > 1 and words[1] in QUICK_VERBS:
                out.append((where, cmd))
    return out


def offline_python() -> list[tuple[str, str]]:
    """Whole programs (they import treadle) that talk to no server."""
    return [(where, code) for where, code in blocks("python") if "from treadle import" in code and "base_url" not in code]


def unique(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The first place each command or program appears (README repeats some of the pages')."""
    seen: dict[str, str] = {}
    for where, code in pairs:
        seen.setdefault(code, where)
    return [(where, code) for code, where in seen.items()]


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def test_the_docs_have_runnable_examples() -> None:
    assert len(quick_commands()) >= 2 and len(offline_python()) >= 2


@pytest.mark.parametrize("where,cmd", unique(quick_commands()), ids=[w for w, _ in unique(quick_commands())])
def test_shell_command_runs(where: str, cmd: str, tmp_path: Path) -> None:
    proc = subprocess.run(cmd, shell=True, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{where}: {cmd}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{where}: {cmd} printed nothing"


@pytest.mark.parametrize("where,code", unique(offline_python()), ids=[w for w, _ in unique(offline_python())])
def test_python_block_runs(where: str, code: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{where}:\n{code}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip(), f"{where}: the example printed nothing"
