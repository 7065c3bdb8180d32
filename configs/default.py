"""The embedded default run: a tiny Qwen3-architecture policy learns arithmetic by RL.

Everything is generated locally (tokenizer, problems, random weights): nothing is
downloaded. A short supervised warm-up on the true answers (`Answer: N`) teaches the format
and stops as soon as the policy's probability of the true answer reaches
`arithmetic.warmup_target_accuracy` (0.15, after about 60 steps), so RL starts from a weak
policy; GRPO with the configured aggregator (`balanced` by default) must then learn the
rest from the `dapo_reward` signal alone.

Command:
  python -m ba_jax.main --config=configs/default.py --workdir=runs/default
  (or `make train`). Variants: `configs/default.py:debug` (a few steps, for tests),
  `configs/default.py:head32` (head_dim 32, which vLLM-CPU needs: for comparing engines).
Expected (measured in docs/benchmarks.md, one 2-core CPU): `accuracy` about 0.15 over the
first 10 of the 500 steps and about 0.9 over the last 50, in about 80-100 s; the run
prints where metrics, plots and checkpoint are.
Compare aggregators: `--config.grpo.aggregation=token` etc., then
  python -m ba_jax.plot runs/a runs/b
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.num_train_steps = 500
    c.log_every = 10  # TensorBoard flush cadence (steps)
    c.max_consecutive_nonfinite = 5  # stop after this many non-finite updates in a row

    # The policy. `preset` names a ModelConfig preset (see ba_jax.models.qwen.PRESETS);
    # empty means the explicit fields below. `init`: random | hf | checkpoint.
    c.model = ml_collections.ConfigDict(
        dict(
            preset="",
            init="random",
            init_path="",  # HF folder (init=hf) or convert_hf output (init=checkpoint)
            arch="qwen3",  # qwen2 (q/k/v bias) | qwen3 (q/k norm)
            vocab_size=101,
            hidden_size=64,
            intermediate_size=192,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            # Positions a row may use (prompt bucket + response - 1); 0: the model's
            # max_position_embeddings. Set it to run past the trained context on purpose.
            position_limit=0,
            dtype="float32",
            param_dtype="float32",
            # Kernel seam (ba_jax.models.attention): auto | xla | chunked | cudnn | splash.
            # auto: splash on TPU, cudnn on GPU (bf16), chunked on CPU for long rows, else xla.
            attention="auto",
            # Per-layer rematerialisation in the backward (ba_jax.models.qwen.REMAT_POLICIES):
            # none | full | dots_saveable | dots_with_no_batch_dims_saveable.
            remat="none",
            # Layers per layer-scan iteration; 2 unrolls this 2-layer model (on its 64-wide
            # layers a loop iteration costs as much as the layer: ~20 ms of an ~105 ms step).
            scan_unroll=2,
            # Response positions per chunk of the output head in the loss (norm, projection,
            # log-softmax): at most [rows, logits_chunk, V] logits exist at once. 0: no chunks.
            logits_chunk=1024,
        )
    )
    c.tokenizer_path = ""  # empty: the embedded task builds WORKDIR/tokenizer

    # Where prompts come from: the embedded arithmetic generator, or a local dataset.
    c.task = "arithmetic"  # arithmetic | dataset
    c.arithmetic = ml_collections.ConfigDict(
        dict(max_operand=9, ops="+", num_problems=100,
             # Supervised warm-up: at most `warmup_steps`, stopped once the policy's
             # probability of the true answer reaches `warmup_target_accuracy`.
             warmup_steps=300, warmup_batch_size=64, warmup_learning_rate=3e-3,
             warmup_correct_frac=1.0, warmup_target_accuracy=0.15)
    )
    c.data = ml_collections.ConfigDict(
        dict(path="", format="auto", template="plain", max_prompt_tokens=64, prompt_suffix="",
             enable_thinking=False)
    )

    c.rollout = ml_collections.ConfigDict(
        dict(prompts_per_step=16, num_samples=16, max_new_tokens=8, temperature=1.0, top_k=0,
             top_p=1.0,
             # Independent sampler calls per step (own key each); a multiple of the number
             # of processes, each of which samples its own shards.
             sample_shards=1,
             # Who samples: "paged", the in-house rollout engine (ba_jax.engine: continuous
             # batching over a paged KV cache, rows split over the mesh's data/fsdp devices;
             # "ba_jax" is its old name, still accepted); "vllm", a vLLM engine process (make
             # vllm builds its environment; ba_jax.vllm_rollout), weights synced every step.
             engine="paged",
             # vLLM only: the engine environment's python ("": the repo's .venv-vllm), skip
             # its torch.compile (a ~10 s start instead of ~40 s, slower decoding).
             # vllm_logprobs: the old name of grpo.old_logp, still accepted ("": unset).
             vllm_python="", vllm_enforce_eager=False, vllm_logprobs="",
             # Engine decode slots per sampler call, split evenly over the row devices (0: a
             # quarter of each device's rows); page_size: tokens per KV page; kv_pages:
             # pages per call, split likewise (0: every slot's largest budget at once);
             # prefill_chunk: prompt tokens prefilled per engine loop step, between decode
             # steps of the busy slots (0: a whole prompt bucket at once).
             num_slots=0, page_size=16, kv_pages=0, prefill_chunk=512)
    )
    c.grpo = ml_collections.ConfigDict(
        dict(
            aggregation="balanced",  # a name in ba_jax.aggregation.RULES or "pkg.mod:fn"
            count_degenerate_groups=True,
            constant_max_len=0,  # C of the `constant` rule; 0 means max_new_tokens
            advantage="grpo",  # grpo | drgrpo | batch_std
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=0.0,  # 0 disables; DAPO-style value 3.0
            kl_kind="none",  # none | k1 | k2 | k3
            kl_beta=0.0,
            num_updates=1,  # PPO epochs over each rollout batch
            num_minibatches=1,  # optimizer steps per epoch (whole groups per mini-batch)
            num_microbatches=1,  # gradient accumulation inside one optimizer step
            # Packed train step: each pass (update, old-log-prob recompute, KL reference)
            # runs on blocks of this many real tokens per row device, sequences side by
            # side with padding removed, as many blocks as a mini-batch needs (the packer
            # balances the devices' loads); num_microbatches must then be 1. 0: padded rows
            # of prompt bucket + max_new_tokens.
            max_tokens_per_device=0,
            dynamic_sampling=False,
            max_resample_rounds=3,
            overlong_buffer=0,  # 0 disables DAPO overlong shaping
            overlong_factor=1.0,
            # Train-inference consistency (docs/consistency.md). old_logp: where pi_old comes
            # from: "recompute" (the trainer's forward over the batch before any update) or
            # "engine" (the sampler's log-probs); "auto": recompute for vllm, engine for
            # paged. logp_check_every: with engine, recompute every N-th step only to log
            # the mismatch rollout_* (0: never); recompute logs it every step.
            old_logp="auto",
            logp_check_every=10,
            # Rollout correction (needs old_logp=recompute): truncated importance weights
            # min(pi_old / pi_engine, threshold) per token or per response (none | token |
            # sequence), and rejection (zero loss weight) of tokens or responses whose
            # ratio leaves [threshold_lower, threshold] (lower 0: 1 / threshold).
            rollout_is="none",
            rollout_is_threshold=2.0,
            rollout_rs="none",
            rollout_rs_threshold=2.0,
            rollout_rs_threshold_lower=0.0,
        )
    )
    c.optim = ml_collections.ConfigDict(
        dict(learning_rate=1.5e-3, schedule="cosine", final_lr_fraction=0.1, weight_decay=0.0,
             grad_clip=1.0, warmup_steps=5, b1=0.9, b2=0.99)
    )
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1: all devices
    # fallback_to_previous: resume from the newest checkpoint that restores whole (finite,
    # checksums as saved), setting damaged ones aside; async_save: a save is written while
    # the next steps run (Orbax's async checkpointing; each step's metrics line still comes
    # first, and a stop waits for the save in flight).
    c.checkpoint = ml_collections.ConfigDict(
        dict(every_steps=50, max_to_keep=2, fallback_to_previous=False, async_save=True)
    )
    # A resume whose config or data differ from the checkpoint's in a key that changes the
    # experiment is refused (ba_jax.resume lists the keys that may change); True continues
    # with the new values and records the changes in metrics.jsonl (`config_changes`).
    c.resume_changed_config = False
    # Scoring: per-item wall-clock limit, pool size (0: one per CPU, at most 8), and
    # whether the regex-only DAPO rule is scored in-process (math-verify never is).
    c.reward = ml_collections.ConfigDict(dict(timeout_s=5.0, num_workers=0, inline_dapo=True))

    if arg == "debug":
        c.num_train_steps = 3
        c.log_every = 1
        c.arithmetic.warmup_steps = 5
        c.rollout.prompts_per_step = 4
        c.rollout.num_samples = 4
        c.rollout.max_new_tokens = 8
        c.model.hidden_size = 32
        c.model.intermediate_size = 64
        c.model.num_layers = 1
        c.model.head_dim = 8
        c.checkpoint.every_steps = 2
    elif arg == "head32":
        # The same width with two 32-wide query heads over one KV head: the smallest head
        # vLLM-CPU's attention takes (it needs head_dim >= 32), so that every rollout engine
        # can run it (benchmarks/engines.py compares them on it).
        c.model.num_heads = 2
        c.model.num_kv_heads = 1
        c.model.head_dim = 32
    elif arg not in (None, ""):
        raise ValueError(f"configs/default.py: unknown variant {arg!r} (valid: '', 'debug', "
                         "'head32')")
    return c
