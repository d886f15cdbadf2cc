"""A loaded CPU model's weights gathered into one anonymous mapping advised for transparent huge pages.

A decode step reads every weight once, in order. In 4 KiB pages that is a TLB miss per page
(SmolLM2's 96 MB: ~24,000 a step); in 2 MiB pages, a few dozen. Linux backs anonymous memory
with huge pages only where asked (``madvise``, the usual ``/sys/kernel/mm/transparent_hugepage/
enabled`` setting) or everywhere (``always``), and then only for 2 MiB-aligned ranges, while
torch allocates each tensor on its own. So after loading, every CPU parameter and buffer of at
least ``MIN_BYTES`` is copied into one 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` (tensors
that share storage keep sharing it: tied embeddings stay one copy) and the tensors point there
(``tensor.data``), the old storage freed tensor by tensor. Resident memory grows by at most the
last huge page's unused part. Values are unchanged; only where they live.

``TREADLE_HUGE_PAGES=0`` keeps torch's allocations. Elsewhere than Linux, or with huge pages
``never``, nothing is moved. The gain (docs/kernels.md "Weights in huge pages"): SmolLM2 Q4_1's
batch-1 decode step 1.06-1.24x on AMD Zen 4.
"""
from __future__ import annotations

import ctypes
import mmap
from itertools import chain
from pathlib import Path

import torch

from treadle import envs

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10
ALIGN = 64  # each storage's start in the mapping (cache lines; any dtype's element size divides it)
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def supported() -> bool:
    """Whether huge pages can back an advised anonymous mapping here (Linux, not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _SETTING.read_text()
    except OSError:
        return False


def describe() -> str:
    """Whether a loaded CPU model's weights go into huge pages here, and why (``treadle doctor``)."""
    if not envs.huge_pages():
        return "no (TREADLE_HUGE_PAGES=0)"
    if not supported():
        return "no (this system has no transparent huge pages to ask for)"
    return f"yes (transparent huge pages: {_SETTING.read_text().split('[')[1].split(']')[0]})"


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8) starting on a 2 MiB boundary of a private anonymous mapping
    advised for huge pages; the tensor keeps the mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused (some sandboxes): ordinary pages, the same values
        pass
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def gather(module: torch.nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move ``module``'s CPU parameters and buffers of at least ``min_bytes`` (by storage) into one
    huge-page mapping when ``TREADLE_HUGE_PAGES`` allows and the system supports it; -> bytes moved."""
    if not envs.huge_pages() or not supported():
        return 0
    users: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}  # storage address -> it, its tensors
    for t in chain(module.parameters(), module.buffers()):
        s = t.untyped_storage()
        if t.device.type == "cpu" and s.nbytes() >= min_bytes:
            users.setdefault(s.data_ptr(), (s, []))[1].append(t)
    if not users:
        return 0
    total = sum(_aligned(s.nbytes()) for s, _ in users.values())
    arena = huge_page_buffer(total)
    target, base, at = arena.untyped_storage(), arena.storage_offset(), 0  # base: the arena's place (bytes)
    while users:
        s, tensors = users.pop(next(iter(users)))
        arena[at : at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
        for t in tensors:
            size = t.element_size()
            t.data = torch.empty(0, dtype=t.dtype).set_(target, (base + at) // size + t.storage_offset(), t.size(), t.stride())
        at += _aligned(s.nbytes())
        del s, tensors  # the old storage goes once no tensor holds it
    _trim_heap()
    return total


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _trim_heap() -> None:
    """Hand the freed storages' pages back to the system (glibc keeps a freed heap chunk resident)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
