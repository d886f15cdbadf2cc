"""Build and load Treadle's C kernels (``csrc/*.c``, one shared library) with ctypes.

The C sources include no torch or Python headers; the first build takes ~20 s on 2 cores
(``gcc -O3 -fopenmp`` and the variant's flags, one process per file); the library is cached under
``$TREADLE_CACHE_DIR`` (default ``~/.cache/treadle``) by a hash of the source, the flags and the
CPU, written atomically under a file lock, so concurrent processes build each library once (the
others wait for it). OpenMP resolves to the ``libgomp.so.1`` torch already loaded, so the kernels
share torch's threads and ``torch.set_num_threads``. ``TREADLE_NATIVE_KERNELS=0`` turns them off;
so does a machine without a C compiler (one warning, then callers fall back to plain torch).

Runtime dispatch: the sources are built once per *variant* (``VARIANTS``, best first, each with its
own ``-m`` flags); the first whose CPU features (``/proc/cpuinfo``) this machine has, and that builds,
is chosen once per process and logged (``describe()``; ``treadle --version``, ``treadle doctor``).
``TREADLE_CPU_KERNELS=<name>`` forces one (a name the CPU cannot run, or an unknown one: a one-line
``TreadleError``). ``plain=True`` / ``variant="plain"`` (tests) calls the plain-C reference build
(``-DTQ_PLAIN_C``); a variant the CPU lacks is never built or run.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share it)

from treadle import envs
from treadle.config import TreadleError
from treadle.kernels import header

logger = logging.getLogger(__name__)

_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE")


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its compiler flags and the CPU features (``/proc/cpuinfo``
    flag names) it needs to run."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]


_AVX2 = ("avx2", "fma", "f16c")
_AVX512_VNNI = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_AVX512_NEEDS = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
VARIANTS = (  # best first; "plain" (the reference) runs everywhere
    # amx: avx512-bf16 plus AMX tiles for the batched 8-bit matmul (csrc/q8amx.c: AMX-INT8, and AMX-BF16 for Q6_K)
    Variant("amx", (*_AVX512_VNNI, "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mtune=native"),
            (*_AVX512_NEEDS, "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")),
    Variant("avx512-bf16", (*_AVX512_VNNI, "-mavx512bf16", "-mtune=native"), (*_AVX512_NEEDS, "avx512_bf16")),
    Variant("avx512-vnni", (*_AVX512_VNNI, "-mtune=native"), _AVX512_NEEDS),
    Variant("avx-vnni", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mtune=native"), (*_AVX2, "avx_vnni")),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c", "-mtune=native"), _AVX2),
    Variant("plain", ("-march=native", "-DTQ_PLAIN_C"), ()),
)
_BY_NAME = {v.name: v for v in VARIANTS}


@cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("flags", "vendor_id", "model name" ...; {} if none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's feature flags as Linux names them (empty where /proc/cpuinfo has none)."""
    return frozenset(cpuinfo().get("flags", "").split())


def rounds_activations_to_bf16(variant: str) -> bool:
    """Whether ``variant``'s bfloat16-weight matmul (csrc/bf16matmul.c, TQ_BF16) rounds float32
    activations to bfloat16 (vdpbf16ps, where K % 32 == 0): its accuracy contract is then the
    reference on bfloat16-rounded activations, to summation order, not the reference itself."""
    return "-mavx512bf16" in _BY_NAME[variant].flags


def missing_features(variant: str, features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The CPU features ``variant`` needs that this machine (or ``features``) lacks (empty: it can run)."""
    have = cpu_features() if features is None else features
    return tuple(f for f in _BY_NAME[variant].needs if f not in have)


def _cache_dir() -> Path:
    return Path(envs.cache_dir()) / "kernels"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")


def _build(compiler: str, flags: tuple[str, ...], sources: list[Path], target: Path) -> None:
    """Each source compiled on its own, as many at once as there are CPUs (the three matmul files
    take ~10 s each at -O3; one serial gcc call took ~40 s for an AVX-512 variant), then linked
    into ``target`` (its folder exists: build_variant made it for the lock)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=target.parent) as objdir:
        objects = [str(Path(objdir) / f"{src.stem}.o") for src in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        try:
            # the slowest files first, so the pool ends together
            jobs = sorted(zip(sources, objects), key=lambda so: -so[0].stat().st_size)
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                for done in [pool.submit(_run, [compiler, *compile_flags, "-c", str(src), "-o", obj]) for src, obj in jobs]:
                    done.result()
            _run([compiler, *flags, *objects, "-o", tmp, "-lm"])
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


@cache
def build_variant(name: str) -> ctypes.CDLL | None:
    """Variant ``name`` built (or found in the cache) and loaded; None when it cannot be."""
    compiler = envs.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: Treadle's CPU kernels are off (plain torch is used)")
        return None
    csrc = Path(__file__).parent / "csrc"
    sources = sorted(csrc.glob("*.c"))
    flags = (*_FLAGS, *_BY_NAME[name].flags)
    digest = hashlib.sha256()
    cpu = cpuinfo().get("flags") or platform.processor() or platform.machine()
    for part in (*(p.read_bytes() for p in sorted(csrc.glob("*.[ch]"))), " ".join(flags).encode(), compiler.encode(), cpu.encode()):
        digest.update(part)
    target = _cache_dir() / f"treadle_kernels_{name}_{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # one build per variant at a time: the ranks of a multi-process engine started on a cold
            # cache wait for the first one's build instead of each compiling the same library
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    _build(compiler, flags, sources, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as exc:
        logger.warning("Treadle's CPU kernels (%s) could not be built: %s", name, exc)
        return None


def check_runnable(name: str, features: frozenset[str] | None = None) -> None:
    """A ``TreadleError`` (one line) unless ``name`` is a variant this CPU (or ``features``) can run."""
    if name not in _BY_NAME:
        raise TreadleError(f"TREADLE_CPU_KERNELS={name!r} is not a kernel variant; choose one of "
                           f"{', '.join(_BY_NAME)} (or auto)")
    missing = missing_features(name, features)
    if missing:
        raise TreadleError(f"TREADLE_CPU_KERNELS={name}: this CPU lacks {' '.join(missing)}, which that variant needs")


def best_runnable() -> str:
    """The first variant in ``VARIANTS`` whose features this CPU has ("plain" at worst)."""
    return next(v.name for v in VARIANTS if not missing_features(v.name))


@cache
def _choose(forced: str | None) -> str | None:
    if forced is not None:
        check_runnable(forced)
        if build_variant(forced) is None:
            raise TreadleError(f"TREADLE_CPU_KERNELS={forced}: that variant could not be built (see the warning)")
        logger.info("Treadle CPU kernels: %s", describe(forced, forced=True))
        return forced
    for v in VARIANTS:
        if not missing_features(v.name) and build_variant(v.name) is not None:
            logger.info("Treadle CPU kernels: %s", describe(v.name, forced=False))
            return v.name
    logger.warning("Treadle's CPU kernels are off (plain torch is used)")
    return None


def packs_at_16_bits(variant: str | None = None) -> bool:
    """Whether ``variant`` (default: the selected one) is a zmm build (csrc/tq.h TQ_ZMM), whose
    packed ``SPLIT_16`` rows take 16-bit activations split in two bytes at about the 8-bit path's
    speed (csrc/q8pack.c tq_q16_split), so the loader packs them at 16 bits too."""
    name = variant or selected_variant()
    return name is not None and set(_AVX512_VNNI) <= set(_BY_NAME[name].flags)


def selected_variant() -> str | None:
    """The variant this process runs: ``TREADLE_CPU_KERNELS``'s when set (checked by
    ``check_runnable``), else the best one the CPU can run that builds; chosen once per value of
    the variable, read at each call (so a test may set it)."""
    if not envs.native_kernels():
        return None
    return _choose(envs.cpu_kernels())


def describe(chosen: str | None = None, forced: bool | None = None) -> str:
    """One line: the chosen variant and why -- forced by ``TREADLE_CPU_KERNELS``, or the best this
    CPU runs, with the better ones it cannot run and what they lack."""
    if forced is None:
        forced = chosen is None and envs.cpu_kernels() is not None
    chosen = chosen or selected_variant()
    if chosen is None:
        return "off (plain torch)"
    if forced:
        return f"{chosen} (forced by TREADLE_CPU_KERNELS; the best this CPU runs: {best_runnable()})"
    better = [v.name for v in VARIANTS][: [v.name for v in VARIANTS].index(chosen)]
    passed = [f"{name} (CPU lacks {' '.join(missing_features(name))})" for name in better if missing_features(name)]
    return f"{chosen} (the best variant this CPU runs" + (f"; skipped {', '.join(passed)})" if passed else ")")


def library(plain: bool = False, variant: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels of ``variant`` (default: the selected one; ``plain``: the plain-C
    reference), or None when they are turned off or cannot be built."""
    name = "plain" if plain else variant or selected_variant()
    if name is None or not envs.native_kernels():
        return None
    if missing_features(name):
        raise ValueError(f"kernel variant {name} cannot run on this CPU (lacks {' '.join(missing_features(name))})")
    return build_variant(name)


def kernel(name: str, plain: bool = False, variant: str | None = None):  # noqa: ANN201
    """The C function ``name`` with its ctypes argument types read from its prototype in
    csrc/tq.h (``treadle.kernels.header``), from the selected variant's build (``plain``: the
    reference build; ``variant``: that one's)."""
    return _kernel(name, "plain" if plain else variant or selected_variant())


@cache
def _kernel(name: str, variant: str | None):  # noqa: ANN202
    lib = library(variant=variant) if variant is not None else None
    assert lib is not None, "Treadle's CPU kernels are not available"
    fn = getattr(lib, name)
    fn.argtypes = header.argtypes(name)
    fn.restype = None
    return fn


def available() -> bool:
    return selected_variant() is not None


# the block types the kernels read, by GGML's own type numbers (csrc/qblocks.h)
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# rows repacked 8 at a time for 8-bit activations (csrc/q8pack.c tq_q8_pack; qblocks.h TQ_PACKED): packed name -> block type
PACKED = {f"{t}x8": t for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")}
# packed types whose rows take 16-bit activations split in two bytes (qblocks.h packed_split16); Q6_K's: 8-bit ones
SPLIT_16 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K")
_PACKED_BASE = 100  # qblocks.h TQ_PACKED: a packed type's number is this plus its block type's (bfloat16 rows: TQ_W_BF16)
LAYOUT_TYPES = {**QTYPES, "BF16": 30, **{p: _PACKED_BASE + QTYPES[b] for p, b in PACKED.items()}}
MAX_SEGMENTS = 4

Segments = tuple[tuple[str, int], ...]  # a weight's rows as (block type or "BF16", row count) runs, in row order


class Layout(ctypes.Structure):
    """csrc/tq.h's ``tq_layout``: the segments of one weight, the activations' bits (16, or 8 for the
    block types csrc/q8act.c reads) and whether small 8-bit batches take the 256-bit paths."""

    _fields_ = [("count", ctypes.c_int32), ("qtype", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int64 * MAX_SEGMENTS), ("act_bits", ctypes.c_int32), ("small_256", ctypes.c_int32)]


def layout(segments: Segments, act_bits: int | None = None) -> Layout:
    """The C description of ``segments`` (built once per distinct layout); ``act_bits`` defaults
    to ``TREADLE_ACTIVATION_BITS``, the small-batch path to ``TREADLE_SMALL_BATCH_PATH``."""
    return _layout(segments, act_bits or envs.activation_bits(), envs.small_batch_path())


def prefers_256_bit_small_batches(vendor_family: tuple[str, int] | None = None,
                                  features: frozenset[str] | None = None) -> bool:
    """Whether 8-bit batches up to q8act.c's register paths (4 rows) skip the AVX-512 zmm strips on this
    CPU (or the given one): on AMD Zen 4 (family 25 with AVX-512) only; why: docs/kernels.md."""
    vendor, family = vendor_family or (cpuinfo().get("vendor_id", ""), cpuinfo().get("cpu family", ""))
    have = cpu_features() if features is None else features
    return vendor == "AuthenticAMD" and str(family) == "25" and "avx512f" in have


@cache
def _layout(segments: Segments, act_bits: int, small_path: str | None = None) -> Layout:
    """small_path: TREADLE_SMALL_BATCH_PATH's 256 / 512, None for this CPU's choice."""
    small_256 = prefers_256_bit_small_batches() if small_path is None else small_path == "256"
    if not 0 < len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"a weight has 1 to {MAX_SEGMENTS} segments, not {len(segments)}")
    if act_bits not in (8, 16):
        raise ValueError(f"activations take 8 or 16 bits, not {act_bits}")
    return Layout(len(segments), tuple(LAYOUT_TYPES[t] for t, _ in segments), tuple(n for _, n in segments), act_bits,
                  int(small_256))


def qmatmul(segments: Segments, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
            plain: bool = False, variant: str | None = None, act_bits: int | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T -> [..., N] float32, W the GGUF blocks ``weight`` (uint8, the
    segments' rows back to back; bfloat16 for "BF16" rows); activations rounded to ``act_bits``
    per block of 32 (layout) for the block types, taken as they are by bfloat16 rows."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    n = sum(rows for _, rows in segments)
    y = torch.empty(flat.shape[0], n, dtype=torch.float32)
    kernel("tq_matmul", plain, variant)(
        ctypes.addressof(layout(segments, act_bits)), weight.data_ptr(), flat.data_ptr(), y.data_ptr(),
        None if bias is None else bias.data_ptr(), flat.shape[0], n, k,
    )
    return y.view(*x.shape[:-1], n)


def gather_rows(qtype: str, weight: torch.Tensor, ids: torch.Tensor, k: int, plain: bool = False) -> torch.Tensor:
    """Rows ``ids`` of GGUF-block weight (rows of K inputs; packed or not) -> [*ids.shape, K] float32."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], k, dtype=torch.float32)
    kernel("tq_gather_rows", plain)(LAYOUT_TYPES[qtype], weight.data_ptr(), flat.data_ptr(), flat.shape[0],
                                              k, out.data_ptr())
    return out.view(*ids.shape, k)


def dequantize(qtype: str, weight: torch.Tensor, n: int, k: int, plain: bool = False) -> torch.Tensor:
    """GGUF-block weight of ``n`` rows of ``k`` inputs (packed or not) -> [n, k] float32."""
    out = torch.empty(n, k, dtype=torch.float32)
    kernel("tq_dequantize", plain)(LAYOUT_TYPES[qtype], weight.data_ptr(), n, k, out.data_ptr())
    return out


def pack_rows(qtype: str, weight: torch.Tensor, n: int, k: int) -> str:
    """Repack ``n`` rows (a multiple of 8) of ``qtype`` blocks in ``weight`` (contiguous uint8) in place
    (csrc/q8pack.c, the same layout in every build); returns the packed type's name."""
    packed = next(p for p, b in PACKED.items() if b == qtype)
    if n % 8 or not weight.is_contiguous() or weight.dtype != torch.uint8:
        raise ValueError(f"packing takes contiguous uint8 rows in groups of 8, not {n} rows of {weight.dtype}")
    kernel("tq_q8_pack")(QTYPES[qtype], weight.data_ptr(), n, k)
    return packed


def w8a8_weight_sums(weight: torch.Tensor) -> torch.Tensor:
    """int8 ``weight`` [N, K] -> its row sums [N] int32, which ``w8a8_matmul`` takes (the VNNI
    build offsets the activations to unsigned bytes and subtracts 128 times these)."""
    return weight.sum(1, dtype=torch.int32).contiguous()


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                plain: bool = False, variant: str | None = None, weight_sums: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 -> [..., N] float32 through csrc/w8a8.c: x quantized to int8 per token,
    then int8 ``weight`` [N, K] (per-row float32 ``weight_scale`` [N]) in exact int32 sums;
    ``weight_sums``: ``w8a8_weight_sums(weight)``, computed here when not given."""
    k = x.shape[-1]
    flat = x.reshape(-1, k).float().contiguous()
    m, n = flat.shape[0], weight.shape[0]
    sums = w8a8_weight_sums(weight) if weight_sums is None else weight_sums
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, dtype=torch.float32)
    kernel("tq_w8a8_quantize", plain, variant)(flat.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr())
    y = torch.empty(m, n, dtype=torch.float32)
    kernel("tq_w8a8_matmul", plain, variant)(
        xq.data_ptr(), xs.data_ptr(), weight.data_ptr(), weight_scale.data_ptr(), sums.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
    )
    return y.view(*x.shape[:-1], n)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, plain: bool = False, variant: str | None = None) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 @ W^T (+ bias) -> [..., N] in ``out_dtype`` (float32 or bfloat16;
    default x's) through csrc/bf16matmul.c: ``weight`` [N, K] bfloat16 contiguous, K % 8 == 0;
    float32 sums of the exact products, rounded once to bfloat16 for a bfloat16 output."""
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.dtype not in (torch.float32, torch.bfloat16):
        flat = flat.float()
    flat = flat.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    n, out_dtype = weight.shape[0], out_dtype or flat.dtype
    y = torch.empty(flat.shape[0], n, dtype=out_dtype)
    kernel("tq_bf16_matmul", plain, variant)(
        weight.data_ptr(), flat.data_ptr(), int(flat.dtype == torch.bfloat16), y.data_ptr(),
        int(out_dtype == torch.bfloat16), None if bias is None else bias.data_ptr(), flat.shape[0], n, k,
    )
    return y.view(*x.shape[:-1], n)
