#!/usr/bin/env bash
# Idempotent setup of the peer engine llama.cpp (llama-cpp-python, compiled from its PyPI
# source distribution) in its own virtual environment.
#
#   bash benchmarks/setup_llama_cpp.sh            # venv at /opt/llama-cpp-venv
#   LLAMA_VENV=/some/dir bash benchmarks/setup_llama_cpp.sh
#   LLAMA_REBUILD=1 bash benchmarks/setup_llama_cpp.sh   # build again (e.g. with other LLAMA_CMAKE_ARGS)
#
# It never touches the main Python environment. The build uses llama-cpp-python's own defaults
# (GGML_NATIVE: tuned to this CPU), as a user's `pip install llama-cpp-python` would; it takes
# about 8 minutes on 2 cores. Re-running it is cheap when the version is already there.
#
# One exception: on a CPU with AMX (Intel Sapphire Rapids and later) the native build's AMX matmul
# segfaults in llama_decode on these VMs (0.3.36, ggml_backend_amx_mul_mat), so there the build is
# the native one minus AMX: every other instruction set the CPU has (AVX512, VNNI, BF16) stays on.
# LLAMA_CMAKE_ARGS overrides the choice.
set -euo pipefail

VENV="${LLAMA_VENV:-/opt/llama-cpp-venv}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"

log() { echo "[setup_llama_cpp] $*"; }

if [ -x "$VENV/bin/python" ]; then
    log "venv present: $VENV"
else
    log "creating venv $VENV"
    "$PY" -m venv "$VENV"
fi

installed="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("llama_cpp_python"))' 2>/dev/null || true)"
if [ "$installed" = "$VERSION" ] && [ -z "${LLAMA_REBUILD:-}" ]; then
    log "llama-cpp-python $VERSION already installed"
else
    flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
    if [ -z "${LLAMA_CMAKE_ARGS+x}" ] && [[ " $flags " == *" amx_int8 "* ]]; then
        LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
        for f in avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI \
                 avx512_bf16:GGML_AVX512_BF16 avx_vnni:GGML_AVX_VNNI; do
            if [[ " $flags " == *" ${f%%:*} "* ]]; then LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS -D${f#*:}=ON"; fi
        done
        log "AMX CPU: building without AMX ($LLAMA_CMAKE_ARGS)"
    fi
    log "building llama-cpp-python==$VERSION from source (about 8 minutes)"
    CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-}" "$VENV/bin/pip" install --no-cache-dir --force-reinstall --no-deps \
        "llama-cpp-python==$VERSION"
    "$VENV/bin/pip" install "llama-cpp-python==$VERSION"  # its dependencies
fi

"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
log "done: $VENV"
