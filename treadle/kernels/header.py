"""The C kernels' ctypes faces, read from their header (``csrc/tq.h``) instead of kept by hand.

``argtypes(name)`` gives an exported function's argument types from its prototype, and
``struct_fields(name)`` a ``typedef struct { ... } name;``'s fields as ctypes ``_fields_``, so
a changed C signature or struct changes the Python side with it. Only what the kernels use is
understood: pointers (``c_void_p``, any pointee), ``int64_t``, ``int32_t``, ``int``, ``float``;
a function taking a struct by value is not callable from here (a KeyError names it).

    void tq_rope(float *x, const float *cos_sin, ..., int64_t row_stride);
        -> argtypes("tq_rope") == [c_void_p, c_void_p, ..., c_int64]
"""
from __future__ import annotations

import ctypes
import re
from functools import cache
from pathlib import Path

HEADER = Path(__file__).parent / "csrc" / "tq.h"
_SCALARS: dict[str, type] = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
                             "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"\b(?:void|int|int64_t|int32_t|float)\s+(tq_\w+)\s*\(([^)]*)\)\s*;")
_STRUCT = re.compile(r"typedef\s+struct\s*\{([^}]*)\}\s*(\w+)\s*;")


@cache
def _source() -> str:
    """The header without comments, its white space folded."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", HEADER.read_text(), flags=re.S)
    return re.sub(r"\s+", " ", text)


def _ctype(decl: str) -> type | None:
    """The ctypes type of one declaration (``const float *x``; ``int64_t n``), None when it is
    a struct passed by value."""
    if "*" in decl:
        return ctypes.c_void_p
    words = decl.replace("const ", "").split()
    return _SCALARS.get(words[0]) if words else None


@cache
def _prototypes() -> dict[str, list[type] | None]:
    out: dict[str, list[type] | None] = {}
    for name, params in _PROTOTYPE.findall(_source()):
        types = [_ctype(p) for p in params.split(",") if p.strip() and p.strip() != "void"]
        out[name] = None if any(t is None for t in types) else [t for t in types if t is not None]
    return out


def argtypes(name: str) -> list[type]:
    """The ctypes argument types of the exported C function ``name``, in order."""
    types = _prototypes().get(name)
    if types is None:
        raise KeyError(f"{name}: no prototype in {HEADER.name} that ctypes can call (scalars and pointers only)")
    return types


def struct_fields(name: str) -> list[tuple[str, type]]:
    """``typedef struct { ... } name;``'s fields as ctypes ``_fields_`` (one declaration may
    name several fields: ``const float *a, *b;``)."""
    for body, struct in _STRUCT.findall(_source()):
        if struct != name:
            continue
        fields: list[tuple[str, type]] = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            base, _, declarators = decl.replace("const ", "").partition(" ")
            for field in (d.strip() for d in declarators.split(",")):
                ftype = ctypes.c_void_p if field.startswith("*") else _SCALARS.get(base)
                if ftype is None or "[" in field:
                    raise KeyError(f"{name}.{field}: a field ctypes cannot be made from here")
                fields.append((field.lstrip("* "), ftype))
        return fields
    raise KeyError(f"{name}: no typedef struct of that name in {HEADER.name}")
