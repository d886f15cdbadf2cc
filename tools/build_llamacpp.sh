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
# JOBS (default 2), NICE (the build's niceness, default 10).
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

ROOT="${TREADLE_CACHE_DIR:-$HOME/.cache/treadle}/llamacpp/${VERSION}-$(cpu_hash)"
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
echo "configuring llama.cpp in $ROOT/build (GGML_NATIVE=ON) ..." >&2
cmake -S "$SRC" -B "$ROOT/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
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
