#!/usr/bin/env bash
# Install ba_jax on a Cloud TPU VM and check that JAX sees the TPU chips; nothing else.
#
#   ./tpu_setup.sh                  # on one TPU VM (single host: v4-8, v5e-8, v6e-8, ...)
#   TPU_NAME=my-slice ZONE=us-central2-b ./tpu_setup.sh --print-pod-command
#                                   # only prints the gcloud lines for every worker of a slice
#
# Installs into .venv (Python 3.11) the versions pinned by pyproject.toml and
# requirements.lock, plus jax[tpu]==0.10.2, which pulls jaxlib 0.10.2 and libtpu 0.0.42.*
# from PyPI. The libtpu release index is passed as well so that mirrors without libtpu
# still resolve it. Test-only extras (torch) are not installed here.
#
# Multi-host: every worker runs the same command with BA_JAX_DISTRIBUTED=auto, which makes
# the trainer call jax.distributed.initialize(); set config.rollout.sample_shards to a
# multiple of the number of workers. See docs/scaling.md (tested on localhost only).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

JAX_VERSION=0.10.2
LIBTPU_INDEX=https://storage.googleapis.com/jax-releases/libtpu_releases.html
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
REMOTE_DIR=${REMOTE_DIR:-ba_jax}
CONFIG=${CONFIG:-configs/paper.py:model=qwen3-1.7b,data=dapo17k,agg=balanced}
WORKDIR=${WORKDIR:-runs/qwen3-1.7b_dapo17k/balanced}

print_pod_command() {
  local name=${TPU_NAME:-TPU_NAME} zone=${ZONE:-ZONE} project=""
  [[ -n "${PROJECT:-}" ]] && project=" --project=$PROJECT"
  cat <<EOF
# 1. copy the committed tree (not .venv or runs) to every worker of the slice
git archive -o ba_jax.tar.gz HEAD
gcloud compute tpus tpu-vm scp ba_jax.tar.gz $name:~ --zone=$zone$project --worker=all
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="mkdir -p ~/$REMOTE_DIR && tar -xzf ~/ba_jax.tar.gz -C ~/$REMOTE_DIR"
# 2. install and check devices on all workers at once (TPU runtimes of a slice start together)
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="cd ~/$REMOTE_DIR && ./tpu_setup.sh"
# 3. start the run on all workers (jax.distributed joins them; WORKDIR must be shared, e.g. gs://)
gcloud compute tpus tpu-vm ssh $name --zone=$zone$project --worker=all --command="cd ~/$REMOTE_DIR && BA_JAX_DISTRIBUTED=auto $VENV/bin/python -m ba_jax.main --config=$CONFIG --workdir=$WORKDIR --config.rollout.sample_shards=${NUM_WORKERS:-NUM_WORKERS}"
EOF
}

if [[ "${1:-}" == "--print-pod-command" ]]; then
  print_pod_command
  exit 0
fi

command -v "$PYTHON" >/dev/null || { echo "tpu_setup.sh: $PYTHON not found (set PYTHON=...)" >&2; exit 1; }
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c requirements.lock \
  -f "$LIBTPU_INDEX" -e . "jax[tpu]==$JAX_VERSION"

# A slice's TPU runtime waits for every worker: bound the check so a single-worker start
# of a multi-host slice fails with a hint instead of hanging.
timeout "${CHECK_TIMEOUT_S:-300}" "$VENV/bin/python" - <<'EOF' || {
import jax

devices = jax.devices()
print(f"jax {jax.__version__}, backend {jax.default_backend()}: {len(devices)} devices, "
      f"{jax.local_device_count()} local, process {jax.process_index()} of {jax.process_count()}")
print(devices)
if jax.default_backend() != "tpu":
    raise SystemExit("tpu_setup.sh: JAX did not find a TPU (is this a TPU VM? is another "
                     "process holding the chips?)")
EOF
  echo "tpu_setup.sh: device check failed or timed out; on a multi-host slice run it on all" \
       "workers at once (--worker=all, see: $0 --print-pod-command)" >&2
  exit 1
}
echo "tpu_setup.sh: ready. To run on every worker of a pod slice:"
print_pod_command
