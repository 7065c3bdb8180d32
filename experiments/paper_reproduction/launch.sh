#!/usr/bin/env bash
# The paper's grid: {Qwen3-1.7B, Qwen2.5-Math-7B} x {DAPO-17k, Polaris} x {sequence, token,
# balanced}: train each run, evaluate its last checkpoint on the six benchmarks, then draw
# the figures (analyze.py). Runs go to RUNS_ROOT/<model>_<data>/<aggregator>/ and resume if
# started again. See README.md next to this file for what each run needs.
#
#   QWEN3_1_7B_CKPT=... QWEN3_1_7B_HF=... QWEN25_MATH_7B_CKPT=... QWEN25_MATH_7B_HF=... \
#   DAPO17K_PATH=... POLARIS_PATH=... BENCH_DIR=... experiments/paper_reproduction/launch.sh
#   SMOKE=1 experiments/paper_reproduction/launch.sh     # tiny end-to-end check on CPU
#
# Environment (defaults in brackets):
#   *_CKPT            convert_hf output folder of each model (model.init=checkpoint)
#   *_HF              Hugging Face folder of each model (its tokenizer is read from there)
#   DAPO17K_PATH, POLARIS_PATH   local training files (see ba_jax/data.py for the layouts)
#   BENCH_DIR         folder with <benchmark>.jsonl/.parquet for ba_jax.evaluate [data/eval]
#   RUNS_ROOT         [runs/paper, smoke: runs/paper_smoke]
#   MODELS, DATASETS, AGGS   space-separated subsets of the grid [all]
#   BENCHMARKS [math500,aime24,aime25,olympiad,minerva,livecodebench]  EVAL_K [16]
#   TRAIN=0 / EVAL=0  skip training / evaluation;  DRY_RUN=1  print the commands only
#   TRAIN_ARGS, EVAL_ARGS   extra flags for ba_jax.main / ba_jax.evaluate
#   PYTHON            [.venv/bin/python]
#   SMOKE=1           configs/default.py:debug per aggregator instead of the real models,
#                     run side by side, no warm-up; SMOKE_STEPS [2]; evaluation on one
#                     tests/fixtures/bench problem
#                     (skipped when ba_jax/evaluate.py is absent)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
SMOKE=${SMOKE:-0}
DRY_RUN=${DRY_RUN:-0}
TRAIN=${TRAIN:-1}
EVAL=${EVAL:-1}
AGGS=${AGGS:-sequence token balanced}
BENCHMARKS=${BENCHMARKS:-math500,aime24,aime25,olympiad,minerva,livecodebench}
EVAL_K=${EVAL_K:-16}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}

run() {  # print, then run unless DRY_RUN=1
  echo "+ $*"
  if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi
}

need() {  # the value of env var $1, or exit naming it
  local v=${!1:-}
  if [[ -z "$v" ]]; then
    echo "launch.sh: set $1 ($2)" >&2
    exit 2
  fi
  printf '%s' "$v"
}

if [[ "$SMOKE" == 1 ]]; then
  RUNS_ROOT=${RUNS_ROOT:-runs/paper_smoke}
  SMOKE_STEPS=${SMOKE_STEPS:-2}
  have_eval=0
  [[ -f ba_jax/evaluate.py ]] && have_eval=1
  smoke_one() {  # train + evaluate one aggregator on the debug config; log to WORKDIR.log
    local agg=$1 wd="$RUNS_ROOT/smoke/$1"
    local cfg=(--config=configs/default.py:debug --config.grpo.aggregation="$agg")
    mkdir -p "$RUNS_ROOT/smoke"
    {
      if [[ "$TRAIN" == 1 ]]; then
        # shellcheck disable=SC2086
        run "$PYTHON" -m ba_jax.main "${cfg[@]}" --config.num_train_steps="$SMOKE_STEPS" \
          --config.arithmetic.warmup_steps=0 --workdir="$wd" $TRAIN_ARGS
      fi
      if [[ "$EVAL" == 1 && "$have_eval" == 1 ]]; then
        # shellcheck disable=SC2086
        run "$PYTHON" -m ba_jax.evaluate "${cfg[@]}" --config.num_train_steps="$SMOKE_STEPS" \
          --checkpoint="$wd" --benchmarks=math500 --k=2 --limit=1 --max_new_tokens=6 \
          --batch_prompts=2 --num_workers=1 --bench_dir=tests/fixtures/bench $EVAL_ARGS
      fi
    } >"$wd.log" 2>&1
  }
  [[ "$have_eval" == 1 ]] || echo "launch.sh: ba_jax/evaluate.py not found; skipping evaluation"
  pids=()
  for agg in $AGGS; do
    smoke_one "$agg" &
    pids+=("$!")
  done
  status=0
  set -- $AGGS
  for pid in "${pids[@]}"; do
    if ! wait "$pid"; then
      echo "launch.sh: smoke run '$1' failed; last lines of $RUNS_ROOT/smoke/$1.log:" >&2
      tail -n 30 "$RUNS_ROOT/smoke/$1.log" >&2 || true
      status=1
    fi
    shift
  done
  [[ "$status" == 0 ]] || exit 1
  for agg in $AGGS; do grep "^+ " "$RUNS_ROOT/smoke/$agg.log" || true; done
  run "$PYTHON" experiments/paper_reproduction/analyze.py "$RUNS_ROOT"
  exit 0
fi

RUNS_ROOT=${RUNS_ROOT:-runs/paper}
MODELS=${MODELS:-qwen3-1.7b qwen2.5-math-7b}
DATASETS=${DATASETS:-dapo17k polaris}
BENCH_DIR=${BENCH_DIR:-data/eval}

for model in $MODELS; do
  case "$model" in
    qwen3-1.7b) ckpt_var=QWEN3_1_7B_CKPT hf_var=QWEN3_1_7B_HF ;;
    qwen2.5-math-7b) ckpt_var=QWEN25_MATH_7B_CKPT hf_var=QWEN25_MATH_7B_HF ;;
    *) echo "launch.sh: unknown model '$model' (qwen3-1.7b, qwen2.5-math-7b)" >&2; exit 2 ;;
  esac
  ckpt=$(need "$ckpt_var" "convert_hf output folder of $model")
  hf=$(need "$hf_var" "Hugging Face folder of $model, for its tokenizer")
  for data in $DATASETS; do
    case "$data" in
      dapo17k) data_path=$(need DAPO17K_PATH "DAPO-Math-17k parquet/JSONL") ;;
      polaris) data_path=$(need POLARIS_PATH "Polaris-Dataset-53K parquet/JSONL") ;;
      *) echo "launch.sh: unknown dataset '$data' (dapo17k, polaris)" >&2; exit 2 ;;
    esac
    for agg in $AGGS; do
      wd="$RUNS_ROOT/${model}_${data}/$agg"
      cfg=(--config="configs/paper.py:model=$model,data=$data,agg=$agg"
           --config.model.init_path="$ckpt" --config.tokenizer_path="$hf"
           --config.data.path="$data_path")
      if [[ "$TRAIN" == 1 ]]; then
        # shellcheck disable=SC2086
        run "$PYTHON" -m ba_jax.main "${cfg[@]}" --workdir="$wd" $TRAIN_ARGS
      fi
      if [[ "$EVAL" == 1 ]]; then
        # shellcheck disable=SC2086
        run "$PYTHON" -m ba_jax.evaluate "${cfg[@]}" --checkpoint="$wd" \
          --benchmarks="$BENCHMARKS" --k="$EVAL_K" --bench_dir="$BENCH_DIR" $EVAL_ARGS
      fi
    done
  done
done
run "$PYTHON" experiments/paper_reproduction/analyze.py "$RUNS_ROOT"
