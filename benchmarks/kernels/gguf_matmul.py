"""SmolLM2-135M's GGUF matmul shapes and ctypes callers of a kernel build's ``tq_matmul``, shared
by the matmul micro-benchmarks beside this module (qmatmul_batch_cpu.py, batched_int8_cpu.py).
"""
from __future__ import annotations

import ctypes

import torch

from treadle.kernels import native

# (name, block type, N, K, times per decode step)
SHAPES = [("qkv", "Q4_1", 960, 576, 30), ("o", "Q4_1", 576, 576, 30), ("gate_up", "Q4_1", 3072, 576, 30),
          ("down", "Q4_1", 576, 1536, 30), ("lm_head", "Q8_0", 49152, 576, 1)]

def caller(lib: ctypes.CDLL, bits: int, qtype: str, w: torch.Tensor, n: int, k: int, x: torch.Tensor):  # noqa: ANN201
    fn = lib.tq_matmul
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    lay = native.layout(((qtype, n),), bits)  # a ref without act_bits reads the fields before it
    y = torch.empty(x.shape[0], n)
    args = (ctypes.addressof(lay), w.data_ptr(), x.data_ptr(), y.data_ptr(), None, x.shape[0], n, k)
    return lambda: fn(*args) or y  # holds y (the kernel writes into it)


def pack_copies(libs: list[ctypes.CDLL], qtype: str, ws: list[torch.Tensor], n: int,
                k: int) -> dict[ctypes.CDLL, list[torch.Tensor]]:
    """Per library, the weight copies packed by its own tq_q8_pack (the layout may differ); a
    library whose bytes equal another's reads that one's copies (see qmatmul_batch_cpu.py's
    docstring). Empty for types that are not packed; a library older than the packed type (a
    ``--ref`` build whose ``tq_q8_type`` does not know it) is left out, so it reads the file's rows."""
    packed: dict[ctypes.CDLL, list[torch.Tensor]] = {}
    if qtype not in native.PACKED.values():
        return packed
    ptype = native.LAYOUT_TYPES[next(p for p, b in native.PACKED.items() if b == qtype)]
    for lib in dict.fromkeys(libs):
        if not lib.tq_q8_type(ptype):
            continue
        mine = [w.clone() for w in ws]
        lib.tq_q8_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        for wp in mine:
            lib.tq_q8_pack(native.QTYPES[qtype], wp.data_ptr(), n, k)
        same = (p for p in packed.values() if all(torch.equal(a, b) for a, b in zip(p, mine)))
        packed[lib] = next(same, mine)
    return packed
