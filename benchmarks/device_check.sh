#!/usr/bin/env bash
# The GPU check, on a GPU node with no package registry (an air-gapped cluster, a fixed image):
#
#   bash benchmarks/device_check.sh                  # on the GPU node
#   bash benchmarks/device_check.sh --force_cpu      # the same code path on CPU, tiny shapes
#   bash benchmarks/device_check.sh -- --steps 5     # after --: options for gpu_step.py
#
# The image brings Python >= 3.11 with jax (and its CUDA plugin), flax, optax,
# orbax-checkpoint, chex and transformers. What ba_jax needs beyond them is small pure-Python
# wheels, downloaded beforehand on a connected machine by `make device-wheels` into
# wheels/device/ (WHEELS=DIR for another folder) and copied over with the repository. This
# script never asks a registry for anything. It
#   1. puts the repository on PYTHONPATH (ba_jax itself is not installed);
#   2. installs, for each module the image lacks, its wheel from $WHEELS with pip --no-index
#      --no-deps into a folder of its own ($SITE, put on PYTHONPATH; the image is not changed),
#      and stops with the list of what is missing if a wheel is not there;
#   3. prints which python, jax, jaxlib, flax, optax, orbax-checkpoint, chex and transformers
#      it runs on, and the devices jax sees;
#   4. runs benchmarks/gpu_step.py: the kernel seam's check (cudnn and chunked against xla,
#      values and gradients), the paged decode check (jax's Triton kernel against the gather
#      path), the Qwen3-1.7B GRPO train step and the rollout engine's sampling (timings, MFU),
#      the engine's bf16 log-prob mismatch against the trainer's forward, then the train
#      step's compiled memory; each result is printed as it comes, and the run
#      is stopped after BUDGET_S seconds (default 420, so the whole check ends within 8
#      minutes on one H100, start-up included);
#   5. leaves in $OUT (default runs/device_check): gpu_step.json and gpu_step.md (the
#      summary, rewritten after every stage, so a run stopped early still has one, marked
#      incomplete) and device_check.log (everything printed).
# Exit status: 0 when every stage ran, 1 otherwise (the summary says how far it got).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$REPO/wheels/device}
OUT=${OUT:-$REPO/runs/device_check}
SITE=${SITE:-$OUT/site}
BUDGET_S=${BUDGET_S:-420}

step_args=()
force_cpu=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --force_cpu) force_cpu=1; shift ;;
    --) shift; step_args+=("$@"); break ;;
    *) step_args+=("$1"); shift ;;
  esac
done
if [[ $force_cpu == 1 ]]; then
  # the code path of every stage on CPU, at shapes a CPU finishes in a few minutes
  step_args=(--force_cpu --preset= --steps 1 --prompts 2 --samples 2 --prompt_len 32
             --response_len 32 --microbatches 1 --sample_prompts 2 --sample_samples 2
             --sample_prompt_len 16 --sample_new_tokens 16 "${step_args[@]}")
  export JAX_PLATFORMS=cpu
fi

mkdir -p "$OUT"
LOG=$OUT/device_check.log
: >"$LOG"
say() { echo "device_check: $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

command -v "$PYTHON" >/dev/null || { say "$PYTHON not found (set PYTHON=...)"; exit 1; }

# 2. module the check imports -> the distribution whose wheel provides it. The image is
# expected to have the first group; the second is what the wheel folder supplies.
IMAGE_MODULES="jax jaxlib flax optax orbax.checkpoint chex transformers numpy safetensors absl yaml"
WHEEL_MODULES="ml_collections:ml_collections"
missing=$("$PYTHON" - $IMAGE_MODULES <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
)
if [[ -n "$missing" ]]; then
  say "the image lacks $missing, which the check cannot do without (no registry here)"
  exit 1
fi
to_install=()
for pair in $WHEEL_MODULES; do
  module=${pair%%:*} dist=${pair#*:}
  if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" 2>/dev/null; then
    wheel=$(ls "$WHEELS"/"$dist"-*.whl 2>/dev/null | head -1)
    [[ -n "$wheel" ]] || { say "no $dist wheel in $WHEELS (make device-wheels on a connected machine, then copy wheels/device here)"; exit 1; }
    to_install+=("$wheel")
  fi
done
if [[ ${#to_install[@]} -gt 0 ]]; then
  say "installing into $SITE from $WHEELS: $(for w in "${to_install[@]}"; do basename "$w"; done | tr '\n' ' ')"
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$SITE" "${to_install[@]}" 2>&1 | tee -a "$LOG" || { say "pip install failed"; exit 1; }
else
  say "the image has every module the check needs; nothing installed"
fi

# 3. what it runs on
"$PYTHON" - <<'PY' 2>&1 | tee -a "$LOG"
import importlib.metadata as md, platform
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "transformers",
         "ml_collections", "jax-cuda13-plugin", "jax-cuda12-plugin"]
found = []
for n in names:
    try:
        found.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        pass
print("device_check: python", platform.python_version() + ";", ", ".join(found))
import jax
print("device_check: devices", jax.devices())
from ba_jax import compat
print("device_check: Triton paged-attention kernel in this jax:", compat.has_gpu_paged_kernel())
PY

# 4. the checks and timings, stopped after BUDGET_S seconds
say "benchmarks/gpu_step.py ${step_args[*]} (budget ${BUDGET_S} s)"
start=$(date +%s)
timeout -k 15 "$BUDGET_S" "$PYTHON" "$REPO/benchmarks/gpu_step.py" --out "$OUT" "${step_args[@]}" \
  2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
took=$(( $(date +%s) - start ))

# 5. the summary
if [[ $rc == 124 || $rc == 137 ]]; then
  note="stopped by the ${BUDGET_S} s budget after ${took} s: the stages below are those that ended"
elif [[ $rc != 0 ]]; then
  note="gpu_step.py failed (exit status $rc) after ${took} s: see device_check.log"
else
  note="finished in ${took} s"
fi
"$PYTHON" - "$OUT" "$note" "$rc" <<'PY'
import json, os, sys
out, note, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
path = os.path.join(out, "gpu_step.json")
data = {"complete": False, "stages": {}}
if os.path.exists(path):
    with open(path) as f:
        data = json.load(f)
data["device_check"] = {"note": note, "exit_status": rc}
with open(path, "w") as f:
    json.dump(data, f, indent=1)
md = os.path.join(out, "gpu_step.md")
text = open(md).read() if os.path.exists(md) else "# benchmarks/gpu_step.py\n"
with open(md, "w") as f:
    f.write(text + f"\ndevice_check.sh: {note}\n")
PY
say "$note; summary: $OUT/gpu_step.md, $OUT/gpu_step.json"
cat "$OUT/gpu_step.md"
exit $(( rc != 0 ))
