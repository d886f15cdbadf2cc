#!/usr/bin/env bash
# Build llama.cpp's own binaries (llama-quantize, llama-bench, llama-batched-bench, llama-server,
# llama-cli) from the sources that llama-cpp-python's source distribution vendors
# (vendor/llama.cpp), for use as the peer in `treadle bench` and as a correctness reference.
# No prebuilt download: the sdist comes from the package index through pip, and cmake builds it
# with GGML_NATIVE=ON for this CPU, only these targets. It takes a while on a shared 2-core
# machine (about 80 minutes beside other work): build once.
#
#   tools/build_llamacpp.sh            # builds once, then caches
#   tools/build_llamacpp.sh            # second run: prints the cached path at once
#
# Cache: ${TREADLE_CACHE_DIR:-~/.cache/treadle}/llamacpp/<version>-<cpu hash>/
#   bin/   the binaries               src/   the vendored llama.cpp tree (convert_hf_to_gguf.py)
# The CPU hash covers the CPU's flags and the compiler, since GGML_NATIVE code runs only where
# it was built. The last line printed is always the bin directory.
#
# Environment: LLAMACPP_PY_VERSION (default 0.3.36), PYTHON (default .venv/bin/python or python3),
# JOBS (default 2), NICE (the build's niceness, default 10), NO_AMX=1: an x86 build with this CPU's
# AVX / AVX2 / AVX-512 (F, VBMI, VNNI, BF16) / AVX-VNNI but without ggml's AMX matmul (GGML_NATIVE off,
# each extension named), cached apart (<version>-<cpu hash>-noamx): on a VM where ggml's AMX tiles
# die with SIGILL, the default build needs --repack 0, which also turns off ggml's repacked
# AVX-512 / AVX2 kernels; this one runs them.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python3; fi
fi
TARGETS=(llama-quantize llama-bench llama-batched-bench llama-server llama-cli)  # the server needs the most

cpu_hash() {
    { grep -m1 '^flags' /proc/cpuinfo || uname -m; "${CXX:-c++}" --version | head -1; } \
        | sha256sum | cut -c1-12
}

ROOT="${TREADLE_CACHE_DIR:-$HOME/.cache/treadle}/llamacpp/${VERSION}-$(cpu_hash)${NO_AMX:+-noamx}"
BIN="$ROOT/bin"

all_built() {
    local t
    for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
}

if all_built; then
    echo "$BIN"
    exit 0
fi

for tool in cmake "${CXX:-c++}"; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp" >&2; exit 1; }
done

mkdir -p "$ROOT"
SRC="$ROOT/src"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    DL="$(mktemp -d)"
    trap 'rm -rf "$DL"' EXIT
    echo "downloading the llama-cpp-python $VERSION source distribution ..." >&2
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$DL" >&2
    tar xzf "$DL"/llama_cpp_python-*.tar.gz -C "$DL"
    rm -rf "$SRC"
    mv "$DL"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
fi

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
ISA=(-DGGML_NATIVE=ON)
if [[ -n "${NO_AMX:-}" ]]; then
    has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1" && echo ON || echo OFF; }
    ISA=(-DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
         -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
         -DGGML_AVX512="$(has avx512bw)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
         -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
         -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
echo "configuring llama.cpp in $ROOT/build (${ISA[*]}) ..." >&2
cmake -S "$SRC" -B "$ROOT/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
echo "building ${TARGETS[*]} with -j$JOBS (nice) ..." >&2
nice -n "${NICE:-10}" cmake --build "$ROOT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2

mkdir -p "$BIN"
for t in "${TARGETS[@]}"; do
    cp "$ROOT/build/bin/$t" "$BIN/$t"
done
all_built || { echo "error: build finished but binaries are missing in $BIN" >&2; exit 1; }
echo "$BIN"
