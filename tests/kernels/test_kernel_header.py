"""The kernels' ctypes faces come from csrc/tq.h (treadle.kernels.header): every prototype the
Python wrappers call is readable, and the decoder-layer struct matches the C layout's size."""
from __future__ import annotations

import ctypes

import pytest

from treadle.kernels import header
from treadle.kernels.layer import LayerArgs

CALLED = ("tq_matmul", "tq_gather_rows", "tq_dequantize", "tq_q8_pack", "tq_w8a8_quantize", "tq_w8a8_matmul",
          "tq_bf16_matmul", "tq_llama_layers_decode", "tq_paged_decode", "tq_rms_norm", "tq_rope", "tq_silu_mul")


@pytest.mark.parametrize("name", CALLED)
def test_prototypes_give_argument_types(name: str) -> None:
    types = header.argtypes(name)
    assert types and all(t in (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_float)
                         for t in types)


def test_a_known_prototype_reads_as_written() -> None:
    # void tq_rope(float *x, const float *cos_sin, const int64_t *positions, int64_t tokens, int64_t heads,
    #              int64_t head_dim, int64_t row_stride);
    assert header.argtypes("tq_rope") == [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4


def test_the_layer_struct_is_the_headers() -> None:
    names = [n for n, _ in LayerArgs._fields_]
    assert names[:3] == ["in_norm", "post_norm", "layouts"] and names[-3:] == ["eps", "scale", "kv_format"]
    # 11 pointers, 6 int64, 2 float, 1 int32 (padded to 8): the C struct's size on x86-64
    assert ctypes.sizeof(LayerArgs) == 11 * 8 + 6 * 8 + 2 * 4 + 8


def test_unknown_names_are_refused() -> None:
    with pytest.raises(KeyError, match="tq_nothing"):
        header.argtypes("tq_nothing")
    with pytest.raises(KeyError, match="tq_q8_rows"):  # takes a struct by value: not callable from ctypes here
        header.argtypes("tq_q8_rows")
