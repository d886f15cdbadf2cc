"""Build and load Treadle's C kernels (``csrc/*.c``, one shared library) with ctypes.

The C sources include no torch or Python headers, so the first build takes about a
second (``gcc -O3 -march=native -fopenmp``); the library is cached under
``$TREADLE_CACHE_DIR`` (default ``~/.cache/treadle``) by a hash of the source, the
flags and the CPU, and written atomically, so concurrent processes are safe. OpenMP
resolves to the ``libgomp.so.1`` torch already loaded, so the kernels share torch's
threads and ``torch.set_num_threads``.

``TREADLE_NATIVE_KERNELS=0`` turns the kernels off; so does a machine without a C
compiler (one warning, then callers fall back to plain torch).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share it)

from treadle import envs

logger = logging.getLogger(__name__)

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE")


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    return Path(envs.cache_dir()) / "kernels"


def _build(compiler: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, *map(str, sources), "-o", tmp, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they are turned off or cannot be built."""
    if not envs.native_kernels():
        return None
    compiler = envs.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: Treadle's CPU kernels are off (plain torch is used)")
        return None
    csrc = Path(__file__).parent / "csrc"
    sources = sorted(csrc.glob("*.c"))
    digest = hashlib.sha256()
    for part in (*(p.read_bytes() for p in sorted(csrc.glob("*.[ch]"))), " ".join(_FLAGS).encode(), compiler.encode(), _cpu_id().encode()):
        digest.update(part)
    target = _cache_dir() / f"treadle_kernels_{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, sources, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as exc:
        logger.warning("Treadle's CPU kernels could not be built (plain torch is used): %s", exc)
        return None


# argument types of a kernel, in its C signature's order (P: a pointer, I: int64_t,
# C: int, F: float); the Python wrappers pass tensors' data_ptr() for pointers
_ARG = {"P": ctypes.c_void_p, "I": ctypes.c_int64, "C": ctypes.c_int, "F": ctypes.c_float}


@cache
def kernel(name: str, signature: str):  # noqa: ANN201
    """The C function ``name`` with ctypes argument types from ``signature`` (e.g. "CPPI")."""
    lib = library()
    assert lib is not None, "Treadle's CPU kernels are not available"
    fn = getattr(lib, name)
    fn.argtypes = [_ARG[c] for c in signature]
    fn.restype = None
    return fn


def available() -> bool:
    return library() is not None


QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def qmatmul(qtype: str, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T -> [..., N] float32, W as GGUF blocks ``weight`` [N, K/32 * block bytes]."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    n = weight.shape[0]
    y = torch.empty(flat.shape[0], n, dtype=torch.float32)
    kernel("tq_matmul", "CPPPPIII")(
        QTYPES[qtype], weight.data_ptr(), flat.data_ptr(), y.data_ptr(),
        None if bias is None else bias.data_ptr(), flat.shape[0], n, k,
    )
    return y.view(*x.shape[:-1], n)


def gather_rows(qtype: str, weight: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` of GGUF-block weight [N, K/32 * block bytes] -> [*ids.shape, K] float32."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], k, dtype=torch.float32)
    kernel("tq_gather_rows", "CPPIIP")(QTYPES[qtype], weight.data_ptr(), flat.data_ptr(), flat.shape[0], k, out.data_ptr())
    return out.view(*ids.shape, k)


def dequantize(qtype: str, weight: torch.Tensor, k: int) -> torch.Tensor:
    """GGUF-block weight [N, K/32 * block bytes] -> [N, K] float32."""
    out = torch.empty(weight.shape[0], k, dtype=torch.float32)
    kernel("tq_dequantize", "CPIIP")(QTYPES[qtype], weight.data_ptr(), weight.shape[0], k, out.data_ptr())
    return out
