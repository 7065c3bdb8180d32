"""The paper's 2 x 2 x 3 grid: {Qwen2.5-Math-7B, Qwen3-1.7B} x {DAPO-17k, Polaris} x aggregator.

Usage (arg is comma-separated key=value; every key is required):
  python -m ba_jax.main \\
    --config=configs/paper.py:model=qwen3-1.7b,data=dapo17k,agg=balanced \\
    --workdir=runs/qwen3-1.7b_dapo17k_balanced \\
    --config.model.init_path=/path/to/converted/Qwen3-1.7B \\
    --config.data.path=/path/to/dapo-math-17k.parquet
model: qwen2.5-math-7b | qwen3-1.7b; data: dapo17k | polaris; agg: sequence | token |
balanced (or any rule in ba_jax.aggregation.RULES).

Weights: convert the Hugging Face folder once with
  python -m ba_jax.models.convert_hf --hf HF_DIR --out CONVERTED_DIR
and point `model.init_path` at CONVERTED_DIR (or use init=hf with the HF folder).
The tokenizer is read from `tokenizer_path` (default: the HF folder, set it explicitly
when init=checkpoint).

Hyper-parameters follow the DAPO recipe (the paper's were not published): AdamW lr 1e-6,
weight decay 0.1, clip 1.0, 10 warm-up steps, 16 responses per prompt, eps 0.2 / 0.28,
no KL, temperature 1.0, top-p 1.0, overlong buffer 4096 with factor 1.0, max response
8192 (Qwen2.5-Math-7B's 4k context is raised to reach that). Expected last-step
six-benchmark accuracy (paper, Table 1): Qwen3-1.7B/DAPO-17k 0.4481 / 0.4360 / 0.4695
and Qwen3-1.7B/Polaris 0.4614 / 0.4349 / 0.4640 for sequence / token / BA;
Qwen2.5-Math-7B/DAPO-17k 0.3446 / 0.3364 / 0.3424, Qwen2.5-Math-7B/Polaris
0.3172 / 0.3292 / 0.3319.

Hardware (mesh fsdp over every device; the update packed, grpo.max_tokens_per_device =
20,480: one row of 20,480 tokens per device per micro-batch, the packer choosing the
micro-batches, at most 32 per mini-batch on 8 devices when every response runs to its
limit; one rollout-engine call of 512 rows with 48 decode slots). Per-device train-step
figures from `python -m ba_jax.plan --config=configs/paper.py:model=...,data=dapo17k,
agg=balanced --num_devices=N --compile` (planned / compiled on fake CPU devices; the
command and the padded figures in docs/benchmarks.md, "Paper shapes, packed"):
  Qwen3-1.7B: 8 devices of >= 32 GiB (8 x H100 / A100-80GB / H200, 8 TPU v5p, v6e or v4
    chips): train step 13.3 / 12.4 GiB (padded rows, 32 micro-batches of 16 rows: 13.2 /
    13.1 GiB), sampling ~24 GiB planned. On 80 GiB devices raise rollout.num_slots (plan:
    up to ~190) for more rows per decode step.
  Qwen2.5-Math-7B (same budget): 16 devices of >= 32 GiB (train 26.8 / 24.9 GiB), or 8 of
    >= 80 GiB (H100 / A100-80GB / H200 / v5p: train 35.6 / 33.5 GiB).
The figures are XLA:CPU's compiled ones; TPU/GPU keep bf16 intermediates in bf16, so on
them the peaks are expected lower (only the hardware can confirm by how much). A larger
budget means fewer, longer blocks: the planner puts Qwen3-1.7B on 8 devices at 15.0 GiB
with 24,576 tokens.
"""

import importlib.util
import os

import ml_collections

MODELS = {
    # name: (preset, template, max_prompt_tokens)
    "qwen2.5-math-7b": ("Qwen2.5-Math-7B", "plain", 2048),
    "qwen3-1.7b": ("Qwen3-1.7B", "chat", 2048),
}
DATA = {"dapo17k": "dapo17k", "polaris": "polaris"}


def _parse(arg: str | None) -> dict[str, str]:
    if not arg:
        raise ValueError("configs/paper.py needs model=...,data=...,agg=... (see its docstring)")
    out = {}
    for part in arg.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"configs/paper.py: {part!r} is not key=value")
        out[key.strip()] = value.strip()
    unknown = set(out) - {"model", "data", "agg"}
    missing = {"model", "data", "agg"} - set(out)
    if unknown or missing:
        raise ValueError(f"configs/paper.py: unknown keys {sorted(unknown)}, missing {sorted(missing)}")
    if out["model"] not in MODELS:
        raise ValueError(f"configs/paper.py: model={out['model']!r}; valid: {', '.join(MODELS)}")
    if out["data"] not in DATA:
        raise ValueError(f"configs/paper.py: data={out['data']!r}; valid: {', '.join(DATA)}")
    return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # The paper config is the default one with every field that differs overridden, so
    # both share one schema (a key valid for one is valid for the other).
    spec = importlib.util.spec_from_file_location(
        "ba_jax_default_config", os.path.join(os.path.dirname(__file__), "default.py"))
    default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(default)
    a = _parse(arg)
    c = default.get_config()
    preset, template, max_prompt = MODELS[a["model"]]
    c.num_train_steps = 500
    c.log_every = 1
    c.task = "dataset"
    c.model.preset = preset
    c.model.init = "checkpoint"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    c.model.scan_unroll = 1  # one layer in the compiled program
    c.model.logits_chunk = 256  # [1 row, 256, 151,936] f32 logits per chunk: 0.15 GiB
    c.data.format = DATA[a["data"]]
    c.data.template = template
    c.data.max_prompt_tokens = max_prompt
    c.data.enable_thinking = False
    c.rollout.prompts_per_step = 512 // 16
    c.rollout.num_samples = 16
    c.rollout.max_new_tokens = 8192
    # One engine call per step: 512 rows, split over the row devices, each running its own
    # engine; 48 decode slots per call (6 per device on 8 devices), each promised a full
    # 8,192-token budget of pages: a 5.3 GiB bf16 pool per device. `python -m ba_jax.plan
    # --config=... --num_devices=N` prints the largest num_slots that fits each device.
    c.rollout.sample_shards = 1
    c.rollout.num_slots = 48
    # Qwen2.5-Math-7B was trained for 4,096 positions; rows here use 2,048 + 8,191. The
    # DAPO/verl recipes for it raise max_position_embeddings the same way.
    c.model.position_limit = 2048 + 8192 - 1 if preset == "Qwen2.5-Math-7B" else 0
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.grpo.aggregation = a["agg"]
    c.grpo.eps_low, c.grpo.eps_high = 0.2, 0.28
    c.grpo.kl_kind, c.grpo.kl_beta = "none", 0.0
    c.grpo.num_updates = 1
    c.grpo.num_minibatches = 1
    # Packed update (docs/scaling.md): one row of 20,480 tokens per device per micro-batch,
    # the sequences of a mini-batch laid side by side (verl's DAPO recipe: 2 x (2,048 +
    # 8,192) per GPU; at least 2,048 + 8,192 - 1, the longest sequence); the packer makes
    # the micro-batches. Qwen3-1.7B on 8 devices: planned 13.3 GiB, compiled 12.4 GiB.
    c.grpo.num_microbatches = 1
    c.grpo.max_tokens_per_device = 20480
    c.grpo.dynamic_sampling = True
    c.grpo.max_resample_rounds = 3
    c.grpo.overlong_buffer = 4096
    c.grpo.overlong_factor = 1.0
    c.optim.learning_rate = 1e-6
    c.optim.schedule = "constant"
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.optim.warmup_steps = 10
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.checkpoint.every_steps = 10
    c.checkpoint.max_to_keep = 3
    c.reward.timeout_s = 10.0
    return c
