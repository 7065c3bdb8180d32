"""The planner's analytic memory model: per-device activation bytes from the shapes of a run.

Lives here: the devices a plan is checked against (`DEVICES`, HBM in GiB), the terms of the
estimate (`memory_features`), their fitted coefficients (`TRAIN_COEF`, `SAMPLE_COEF`,
`FIXED_COEF`: least squares on XLA's compiled temp bytes, `benchmarks/memory.py
--calibrate`), `activation_estimate` and `exact_temp_bytes`. Not here:
reading a config and adding up a plan (`plan.py`), compiling the real programs (`plan.py`'s
`compiled_memory`).
"""

from __future__ import annotations

GIB = 1024**3
# HBM per chip / GPU, GiB (TPU: per chip as Cloud TPU documents it; GPU: the SKU's size).
DEVICES: dict[str, float] = {
    "v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100-80g": 80, "h100": 80, "h200": 141,
}


def _tp(n: int, tensor: int) -> float:
    """Per-device share of a dimension split over `tensor` when it divides (as spec_for)."""
    return n / tensor if n % tensor == 0 else n


def _per_dev(rows: int, dp: int) -> int:
    """Rows on one device: split over data x fsdp when they divide, else replicated."""
    return rows // dp if rows % dp == 0 else rows


# The activation estimate: bytes = sum over terms of (bytes per element) x (the term's
# element count on one device, `memory_features`). Terms of the train step (remat full,
# flash-type attention: chunked, splash or cudnn; b rows per device per micro-batch,
# T = prompt bucket + R - 1 positions, c = model.logits_chunk):
#   saved_inputs  L b T D    each layer's input, kept by the layer scan for the backward
#   layer_embed   b T D      one layer recomputed in the backward: D-wide values (norms,
#   layer_mlp     b T F/t      residuals, their cotangents), MLP gate/up/product, queries
#   layer_q       b T N H/t    and attention outputs, keys and values, each with its
#   layer_kv      b T 2K H/t   cotangent and the kernel's float32 accumulators
#   head_weight   V D/t      the output projection (or tied embedding) gathered whole,
#                            and the embedding gradient's scatter-add before it is reduced
#   head_chunk    b c V/t    one chunk of float32 logits, probabilities and their cotangent
# of the sampler call (B rows and P prompts per device, R new tokens, Tp prompt bucket):
#   kv_cache      2 L K H (B R + P Tp)   the decode cache and the shared prompt cache; the
#                                        engine's: its page pool (prompts' pages too),
#                                        2 L K H pages x page_size
#   prefill       P Tp (D + F)           one layer's prefill working set (the engine's: one
#                                        chunk of one prompt, rollout.prefill_chunk tokens)
#   decode_vocab  B V/t                  one decode step's logits and sampling arrays (the
#                                        engine's: its S slots)
#   head_weight   V D/t
# Exact and added as they are: parameters, optimizer state, gradients (parameter dtype),
# the float32 gradient accumulator, the batch. The coefficients are least-squares fits to
# XLA's compiled temp bytes on 4-layer cuts of Qwen3-1.7B at the paper's row length
# (`python benchmarks/memory.py --calibrate`), per compute itemsize; they are XLA:CPU's:
# it widens bf16 intermediates to f32 and fuses less than TPU/GPU, so on accelerators the
# estimate is an upper bound (only a device's measured peak, benchmarks/gpu_step.py, says
# by how much). Remat `none` keeps every layer's working set (the layer terms x L); the
# `dots_*` policies are counted as `none` (an upper bound). `xla` attention adds its
# materialised [N, T, T] scores (f32 and the compute-dtype copy) per layer kept.
COEF_TERMS: dict[str, tuple[str, ...]] = {
    "train": ("saved_inputs", "layer_embed", "layer_mlp", "layer_q", "layer_kv", "head_weight"),
    "sample": ("kv_cache", "prefill", "head_weight"),
}
_LAYER_TERMS = ("layer_embed", "layer_mlp", "layer_q", "layer_kv")
# Not least-squares fitted: bytes per logit of the head's backward, measured on a cut whose
# head is unchunked (`--calibrate` prints it: ~8.5 in bf16 and f32; float32 logits, their
# exponentials and the cotangent, partly fused), and per element of one decode step's
# vocabulary arrays (logits, probabilities, the top-p sort: too small to identify).
FIXED_COEF = dict(head_chunk=8.5, decode_vocab=12.0)
# Fitted by `python benchmarks/memory.py --calibrate` (XLA:CPU, jax 0.10.2), per compute
# itemsize; bytes per element of each term.
TRAIN_COEF: dict[int, dict[str, float]] = {
    2: dict(saved_inputs=4.0, layer_embed=33.6, layer_mlp=14.8, layer_q=20.7, layer_kv=12.2,
            head_weight=1.8),
    4: dict(saved_inputs=3.9, layer_embed=33.6, layer_mlp=25.2, layer_q=21.3, layer_kv=12.7,
            head_weight=4.2),
}
SAMPLE_COEF: dict[int, dict[str, float]] = {
    2: dict(kv_cache=5.9, prefill=1.7, head_weight=2.5),
    4: dict(kv_cache=3.7, prefill=6.5, head_weight=6.8),
}


def memory_features(p: dict, kind: str) -> dict[str, float]:
    """Element counts on one device of the activation terms (`COEF_TERMS[kind]`) of the
    plan `p` (`plan(...)`): kind "train" (one micro-batch of the train step) or "sample"
    (one sampler call)."""
    mc, s, t = p["model"], p["shapes"], p["mesh"]["tensor"]
    D, F, H, L = mc.hidden_size, mc.intermediate_size, mc.head_dim, mc.num_layers
    N, K, V = mc.num_heads, mc.num_kv_heads, mc.vocab_size
    head_weight = V * D / (t if V % t == 0 else 1)
    if kind == "train":
        bT = s["microbatch_rows_per_device"] * s["seq_len"]
        layers = 1 if s["remat"] == "full" else L  # working sets kept at once
        return dict(saved_inputs=L * bT * D, layer_embed=layers * bT * D,
                    layer_mlp=layers * bT * _tp(F, t), layer_q=layers * bT * _tp(N, t) * H,
                    layer_kv=layers * bT * 2 * _tp(K, t) * H, head_weight=head_weight,
                    head_chunk=s["microbatch_rows_per_device"] * s["head_chunk"] * _tp(V, t))
    if kind == "sample":
        return dict(kv_cache=2 * L * _tp(K, t) * H * s["kv_tokens"],
                    prefill=s["prefill_tokens"] * (D + _tp(F, t)),
                    decode_vocab=s["decode_rows"] * _tp(V, t), head_weight=head_weight)
    raise ValueError(f"kind={kind!r}; valid: train, sample")


def exact_temp_bytes(p: dict, kind: str) -> int:
    """The part of a compiled program's temp bytes the plan knows exactly: the train step's
    gradients and float32 accumulator (the sampler has none)."""
    b = p["bytes"]
    return b["grads"] + b["grad_accumulator"] if kind == "train" else 0


def activation_estimate(p: dict, kind: str) -> dict[str, int]:
    """Estimated activation bytes on one device per term and `total`: the train step holds
    the saved layer inputs, the head weight and the larger of one layer's backward working
    set and one logits chunk's (the two phases do not overlap); the sampler all its terms."""
    coef = dict((TRAIN_COEF if kind == "train" else SAMPLE_COEF)[4 if p["itemsize"] >= 4 else 2],
                **FIXED_COEF)
    out = {k: int(coef[k] * v) for k, v in memory_features(p, kind).items()}
    s, mc = p["shapes"], p["model"]
    if kind == "sample":
        total = sum(out.values())
    else:
        if s["attention"] == "xla":  # [b, N, T, T] scores of each layer kept
            layers = 1 if s["remat"] == "full" else mc.num_layers
            out["attention_scores"] = int(layers * s["microbatch_rows_per_device"]
                                          * _tp(mc.num_heads, p["mesh"]["tensor"])
                                          * s["seq_len"] ** 2 * (4 + p["itemsize"]))
        layer = sum(out[k] for k in _LAYER_TERMS) + out.get("attention_scores", 0)
        total = out["saved_inputs"] + out["head_weight"] + max(layer, out["head_chunk"])
    out["total"] = total
    return out
