#!/usr/bin/env bash
# Install ba_jax on a Cloud TPU VM and check that JAX sees the TPU chips; nothing else.
#
#   ./tpu_setup.sh                  # on one TPU VM (single host: v4-8, v5e-8, v6e-8, ...)
#   ./tpu_setup.sh --dry-run        # only print the commands it would run (anywhere)
#   ./tpu_setup.sh --python-only    # only find (or get) the Python and print its path
#   JAX_VERSION=0.10.2 ./tpu_setup.sh   # another jax release of the supported range
#   TPU_NAME=my-slice ZONE=us-central2-b ./tpu_setup.sh --print-pod-command
#                                   # only prints the gcloud lines for every worker of a slice
#
# jax: by default the newest release ba_jax supports (JAX_VERSION, default the jax pin of
# requirements-latest.lock), installed as jax[tpu]==JAX_VERSION, which pulls the matching
# jaxlib and libtpu from PyPI (the libtpu release index is passed as well, for mirrors without
# libtpu). The other packages come pinned by the lock file whose jax is JAX_VERSION
# (requirements-latest.lock, or requirements.lock for 0.10.2), else within pyproject.toml's
# ranges. Test-only extras (torch) are not installed here.
#
# Python: jax >= 0.11 needs Python 3.12 (0.10.2: 3.11 or 3.12), and the stock TPU VM images
# (Ubuntu 22.04) have Python 3.10. The first of these that works is used, without root:
#   1. $PYTHON, if set;
#   2. python3.12 (python3.11 too for jax 0.10.2) on PATH;
#   3. uv (pip-installed for this user if it is not on PATH: `python3 -m pip install --user
#      uv`), which installs a standalone CPython build (python-build-standalone, the builds uv
#      manages) under ~/.local/share/uv/python: `uv python install 3.12`.
# Into .venv made with that Python it installs ba_jax (editable) and jax[tpu], then prints the
# versions and jax.devices(), and fails unless the backend is TPU.
#
# Multi-host: every worker runs the same command with BA_JAX_DISTRIBUTED=auto, which makes
# the trainer call jax.distributed.initialize(); set config.rollout.sample_shards to a
# multiple of the number of workers. See docs/scaling.md (tested on localhost only).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

LIBTPU_INDEX=https://storage.googleapis.com/jax-releases/libtpu_releases.html
lock_jax() { sed -n 's/^jax==//p' "$1"; }
JAX_VERSION=${JAX_VERSION:-$(lock_jax requirements-latest.lock)}
VENV=${VENV:-.venv}
REMOTE_DIR=${REMOTE_DIR:-ba_jax}
CONFIG=${CONFIG:-configs/paper.py:model=qwen3-1.7b,data=dapo17k,agg=balanced}
WORKDIR=${WORKDIR:-runs/qwen3-1.7b_dapo17k/balanced}

DRY_RUN=0 PYTHON_ONLY=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  --python-only) PYTHON_ONLY=1 ;;
  --print-pod-command|"") ;;
  *) echo "tpu_setup.sh: unknown option $1 (--dry-run, --python-only, --print-pod-command)" >&2
     exit 2 ;;
esac

# The lock whose jax is JAX_VERSION pins everything else; other releases: pyproject's ranges.
LOCK=""
for f in requirements-latest.lock requirements.lock; do
  [[ "$(lock_jax "$f")" == "$JAX_VERSION" ]] && { LOCK=$f; break; }
done
# jax >= 0.11 needs Python 3.12; 0.10.x runs on 3.11 too
case "$JAX_VERSION" in
  0.10.*) PYTHON_VERSIONS=${PYTHON_VERSIONS:-"3.12 3.11"} ;;
  *) PYTHON_VERSIONS=${PYTHON_VERSIONS:-"3.12"} ;;
esac
UV_PYTHON_VERSION=${PYTHON_VERSIONS%% *}

print_pod_command() {
  local name=${TPU_NAME:-TPU_NAME} zone=${ZONE:-ZONE} project=""
  [[ -n "${PROJECT:-}" ]] && project=" --project=$PROJECT"
  cat <<EOF
# 1. copy the committed tree (not .venv or runs) to every worker of the slice
git archive -o ba_jax.tar.gz HEAD
gcloud compute tpus tpu-vm scp ba_jax.tar.gz $name:~ --zone=$zone$project --worker=all
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="mkdir -p ~/$REMOTE_DIR && tar -xzf ~/ba_jax.tar.gz -C ~/$REMOTE_DIR"
# 2. install and check devices on all workers at once (TPU runtimes of a slice start together)
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="cd ~/$REMOTE_DIR && JAX_VERSION=$JAX_VERSION ./tpu_setup.sh"
# 3. start the run on all workers (jax.distributed joins them; WORKDIR must be shared, e.g. gs://)
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="cd ~/$REMOTE_DIR && BA_JAX_DISTRIBUTED=auto $VENV/bin/python -m ba_jax.main --config=$CONFIG --workdir=$WORKDIR --config.rollout.sample_shards=${NUM_WORKERS:-NUM_WORKERS}"
EOF
}

if [[ "${1:-}" == "--print-pod-command" ]]; then
  print_pod_command
  exit 0
fi

# Print a command, then run it (only print it with --dry-run).
run() {
  echo "+ $*"
  [[ $DRY_RUN == 1 ]] || "$@"
}

# Whether $1 is a Python whose major.minor is one of PYTHON_VERSIONS.
supported_python() {
  local v
  v=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
  [[ " $PYTHON_VERSIONS " == *" $v "* ]]
}

# uv on PATH, or pip-installed for this user (into the active virtualenv if there is one:
# pip refuses --user there); prints its path.
find_uv() {
  if command -v uv >/dev/null; then command -v uv; return; fi
  local boot user=--user
  boot=$(command -v python3 || command -v python) || {
    echo "tpu_setup.sh: no python3 to install uv with" >&2; return 1; }
  "$boot" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' && user=""
  if ! "$boot" -c 'import uv' 2>/dev/null; then
    run "$boot" -m pip install -q --disable-pip-version-check $user uv >&2
  fi
  if [[ $DRY_RUN == 1 ]] && ! "$boot" -c 'import uv' 2>/dev/null; then
    echo uv; return
  fi
  "$boot" -c 'import uv; print(uv.find_uv_bin())'
}

# A supported Python's path (see the header), obtaining one with uv when none is installed.
find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    supported_python "$PYTHON" || {
      echo "tpu_setup.sh: PYTHON=$PYTHON is not Python $PYTHON_VERSIONS (jax $JAX_VERSION)" >&2
      return 1; }
    echo "$PYTHON"; return
  fi
  local v py uv
  for v in $PYTHON_VERSIONS; do
    if py=$(command -v "python$v") && supported_python "$py"; then echo "$py"; return; fi
  done
  echo "tpu_setup.sh: no Python $PYTHON_VERSIONS on PATH (this system's python3 is" \
       "$(python3 -c 'import platform; print(platform.python_version())' 2>/dev/null ||
          echo absent)); getting Python $UV_PYTHON_VERSION with uv" >&2
  uv=$(find_uv)
  run "$uv" python install "$UV_PYTHON_VERSION" >&2
  if [[ $DRY_RUN == 1 ]] && ! py=$("$uv" python find "$UV_PYTHON_VERSION" 2>/dev/null); then
    echo "\$($uv python find $UV_PYTHON_VERSION)"; return
  fi
  "$uv" python find "$UV_PYTHON_VERSION"
}

PY=$(find_python)
if [[ $PYTHON_ONLY == 1 ]]; then
  echo "tpu_setup.sh: Python $("$PY" -c 'import platform; print(platform.python_version())'): $PY"
  exit 0
fi
echo "tpu_setup.sh: jax[tpu]==$JAX_VERSION with Python $PY ($("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo 'to be installed')); pins: ${LOCK:-pyproject.toml ranges}"
constraint=()
[[ -n "$LOCK" ]] && constraint=(-c "$LOCK")
if [[ ! -x "$VENV/bin/python" ]] || ! supported_python "$VENV/bin/python"; then
  run "$PY" -m venv --clear "$VENV"
fi
run "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
run "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${constraint[@]}" \
  -f "$LIBTPU_INDEX" -e . "jax[tpu]==$JAX_VERSION"

CHECK=$(cat <<'EOF'
import importlib.metadata as md, platform
import jax

names = ["jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "chex", "transformers"]
got = []
for n in names:
    try:
        got.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        pass
print(f"python {platform.python_version()}; " + ", ".join(got))
devices = jax.devices()
print(f"jax {jax.__version__}, backend {jax.default_backend()}: {len(devices)} devices, "
      f"{jax.local_device_count()} local, process {jax.process_index()} of {jax.process_count()}")
print(devices)
if jax.default_backend() != "tpu":
    raise SystemExit("tpu_setup.sh: JAX did not find a TPU (is this a TPU VM? is another "
                     "process holding the chips?)")
EOF
)
# A slice's TPU runtime waits for every worker: bound the check so a single-worker start
# of a multi-host slice fails with a hint instead of hanging.
if [[ $DRY_RUN == 1 ]]; then
  echo "+ timeout ${CHECK_TIMEOUT_S:-300} $VENV/bin/python -c '<print the versions and" \
       "jax.devices(); fail unless the backend is tpu>'"
  exit 0
fi
timeout "${CHECK_TIMEOUT_S:-300}" "$VENV/bin/python" -c "$CHECK" || {
  echo "tpu_setup.sh: device check failed or timed out; on a multi-host slice run it on all" \
       "workers at once (--worker=all, see: $0 --print-pod-command)" >&2
  exit 1
}
echo "tpu_setup.sh: ready. To run on every worker of a pod slice:"
print_pod_command
