"""Dense Qwen2/2.5 and Qwen3 decoders in flax.nnx: their configs and the one forward path.

Lives here: `ModelConfig` (+ `PRESETS`, `ModelConfig.from_hf_config`), `Attention`,
`DecoderLayer`, the `Qwen` module, and `FullAttention`, the cache mode of a full causal
forward. Not here: the blocks (`layers.py`: projections, norms, RoPE, MLP), the attention
kernels (`attention/`, the one seam that knows which kernel runs), the paged cache and its
modes (the rollout engine's `engine/paging.py`), the Hugging Face key table (`hf_table.py`)
and file IO (`convert_hf.py`), parameter shardings (`sharding.py`).

Call interface:

    model = Qwen(config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    logits_BTV = model(tokens_BT, positions_BT=None, attn_mask_BT=None)    # float32 logits

`attn_mask_BT` is 1 for real tokens and 0 for padding; a token attends causally to the real
tokens at or before it, and a padding token's attention output is 0. `positions_BT` defaults to
`arange(T)` without a mask and to the number of real tokens before each token with one (the
same thing for unpadded or right-padded rows, the right thing for left-padded ones).
`model(tokens_BT)` is the Hugging Face call. Packed rows (several sequences per row) pass
`segments=attention.Segments(ids_BT, max_segments)`: attention stays within a segment and
positions default to each token's index within its segment (`segments.positions`).

One forward path: `Qwen.forward(tokens_BT, positions_BT, cache)` runs the embedding and the
layer scan; every decoder layer has one `__call__(x, rope, attend)` whose attention is
supplied by the cache mode in use. A cache mode is any object with

    remat: bool                               # the backward may run through it (remat applies)
    layer_xs(num_layers) -> xs                # per-layer inputs (leading L axis), or None
    init() -> state                           # carried through the layer scan, or None
    attend(q_BTNH, k_BTKH, v_BTKH, xs_l, state) -> (o_BTNH, state, ys_l)
    finish(state, ys) -> result               # after the scan (ys stacked over layers)

`FullAttention` (here) is the full causal forward (optionally keeping every layer's keys),
over one sequence per row or packed rows (its `segments`); the rollout engine's paged decode
and chunked prefill are modes of its own. The residual block, the activation sharding
constraints and the remat policy are written once, for every mode.

Layers: the decoder layers are ONE `DecoderLayer` whose parameters carry a leading `layers`
axis (L), run by `lax.scan` with the remat policy of `config.remat` inside the scanned body, so
a compiled program holds one layer, not L (parameter paths: `layers.self_attn.q_proj.kernel`
of shape [L, D, N, H]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ba_jax import sharding
from ba_jax.models import attention as attention_lib
from ba_jax.models.attention import segments as segments_lib
from ba_jax.models.layers import (
    KV_AXES,
    LOGITS_AXES,
    MLP,
    Q_AXES,
    X_AXES,
    Embed,
    Linear,
    RMSNorm,
    mm,
    rope,
    rope_tables,
)

# config.remat -> the policy of `jax.checkpoint` around one scanned layer (None: no remat).
# `full` keeps only each layer's input (the paper configs); `dots_with_no_batch_dims_saveable`
# keeps the projections' outputs and recomputes attention and the elementwise work.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one dense Qwen2/2.5/3 model (Hugging Face field names in brackets)."""

    arch: str  # "qwen2" or "qwen3" (model_type); decides the exported architecture
    vocab_size: int  # V (vocab_size)
    hidden_size: int  # D (hidden_size)
    intermediate_size: int  # F, SwiGLU hidden width (intermediate_size)
    num_layers: int  # L (num_hidden_layers)
    num_heads: int  # N query heads (num_attention_heads)
    num_kv_heads: int  # K key/value heads, N % K == 0 (num_key_value_heads)
    head_dim: int  # H (head_dim, else hidden_size // num_attention_heads)
    rope_theta: float  # RoPE base (rope_theta / rope_parameters["rope_theta"])
    rms_norm_eps: float  # RMSNorm epsilon (rms_norm_eps)
    max_position_embeddings: int  # longest context the published model was trained for
    use_tied_embeddings: bool  # lm_head shares embed_tokens (tie_word_embeddings)
    use_qkv_bias: bool  # bias on q/k/v projections (Qwen2: always; Qwen3: attention_bias)
    use_o_bias: bool  # bias on o_proj (Qwen3 attention_bias only)
    use_qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # Run-time choices, not architecture (a checkpoint does not fix them):
    attention: str = "auto"  # kernel seam implementation, see ba_jax.models.attention.IMPLS
    remat: str = "none"  # what the backward recomputes per layer: a name in REMAT_POLICIES
    # Layers per iteration of the layer scan (lax.scan's `unroll`): 1 keeps one layer in the
    # compiled program; >= num_layers unrolls the stack (small models, where an iteration's
    # loop overhead and the fusion it blocks cost as much as a layer's work).
    scan_unroll: int = 1
    # Positions per chunk of the output head when scoring tokens (`Qwen.token_logprobs`):
    # the final norm, projection and log-softmax run chunk by chunk, so at most
    # [rows, logits_chunk, V] logits exist at once; 0: all positions in one piece.
    logits_chunk: int = 1024
    # Run the Pallas kernels (splash, the GPU paged-attention kernel) in the Pallas
    # interpreter: how they are checked without the hardware (part of the jit cache key,
    # being in the model's static structure).
    kernel_interpret: bool = False
    bos_token_id: int | None = None  # kept for export only
    eos_token_id: int | tuple[int, ...] | None = None  # kept for export only

    def __post_init__(self):
        if self.arch not in ("qwen2", "qwen3"):
            raise ValueError(f"arch must be 'qwen2' or 'qwen3', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not a multiple of {self.num_kv_heads=}")
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(f"model.attention={self.attention!r}; valid: "
                             f"{', '.join(attention_lib.IMPLS)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; valid: {', '.join(REMAT_POLICIES)}")
        if not (isinstance(self.scan_unroll, int) and self.scan_unroll >= 1):
            raise ValueError(f"model.scan_unroll={self.scan_unroll!r} must be an integer >= 1")
        if not (isinstance(self.logits_chunk, int) and self.logits_chunk >= 0):
            raise ValueError(f"model.logits_chunk={self.logits_chunk!r} must be an integer >= 0")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face Qwen2/Qwen3 config.json dict (transformers 4.x or 5.x layout)."""
        arch = hf.get("model_type")
        archs = hf.get("architectures") or []
        if arch not in ("qwen2", "qwen3") or any(
            a not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") for a in archs
        ):
            raise ValueError(
                f"unsupported architecture: model_type={arch!r}, architectures={archs}; "
                "expected qwen2/Qwen2ForCausalLM or qwen3/Qwen3ForCausalLM"
            )
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (only 'default')")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        for key in ("use_sliding_window", "use_mrope"):
            if hf.get(key):
                raise ValueError(f"unsupported config option {key}=True")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only 'silu')")
        heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            use_tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            use_qkv_bias=True if arch == "qwen2" else bias,
            use_o_bias=False if arch == "qwen2" else bias,
            use_qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )


def _qwen2(v, d, f, layers, n, k, theta, max_pos, tie) -> ModelConfig:
    return ModelConfig("qwen2", v, d, f, layers, n, k, d // n, theta, 1e-6, max_pos, tie,
                       use_qkv_bias=True, use_o_bias=False, use_qk_norm=False,
                       bos_token_id=151643, eos_token_id=151643)


def _qwen3(d, f, layers, n, k, tie) -> ModelConfig:
    return ModelConfig("qwen3", 151936, d, f, layers, n, k, 128, 1e6, 1e-6, 40960, tie,
                       use_qkv_bias=False, use_o_bias=False, use_qk_norm=True,
                       bos_token_id=151643, eos_token_id=151645)


# The published config.json of each base model (Qwen/<name> on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "Qwen2.5-0.5B": _qwen2(151936, 896, 4864, 24, 14, 2, 1e6, 32768, True),
    "Qwen2.5-1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, 1e6, 131072, True),
    "Qwen2.5-7B": _qwen2(152064, 3584, 18944, 28, 28, 4, 1e6, 131072, False),
    "Qwen2.5-Math-1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, 1e4, 4096, True),
    "Qwen2.5-Math-7B": _qwen2(152064, 3584, 18944, 28, 28, 4, 1e4, 4096, False),
    "Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": _qwen3(2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": _qwen3(4096, 12288, 36, 32, 8, False),
}


class Attention(nnx.Module):
    """Grouped-query self-attention; query head n uses kv head n // (N // K) as in HF. The
    attention itself is the cache mode's (`attend`)."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        qkv = dict(use_bias=cfg.use_qkv_bias, **kw)
        self.q_proj = Linear((D,), (N, H), axes=("embed", "heads", "head_dim"), **qkv)
        self.k_proj = Linear((D,), (K, H), axes=("embed", "kv_heads", "head_dim"), **qkv)
        self.v_proj = Linear((D,), (K, H), axes=("embed", "kv_heads", "head_dim"), **qkv)
        self.o_proj = Linear((N, H), (D,), axes=("heads", "head_dim", "embed"),
                             use_bias=cfg.use_o_bias, **kw)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.q_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(H, **nkw) if cfg.use_qk_norm else None

    def __call__(self, x_BTD, rope_BTH, attend):
        """-> (output x_BTD, what `attend(q, k, v)` returned beside the attention output).
        Queries and keys after q/k norm and RoPE, values; all in the compute dtype."""
        sin_BTH, cos_BTH = rope_BTH
        q_BTNH, k_BTKH, v_BTKH = self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = sharding.constrain(rope(q_BTNH, sin_BTH, cos_BTH), Q_AXES)
        k_BTKH = sharding.constrain(rope(k_BTKH, sin_BTH, cos_BTH), KV_AXES)
        v_BTKH = sharding.constrain(v_BTKH, KV_AXES)
        o_BTNH, aux = attend(q_BTNH, k_BTKH, v_BTKH)
        return self.o_proj(sharding.constrain(o_BTNH, Q_AXES)), aux


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs, dtype, param_dtype):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, **kw)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **nkw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **nkw)

    def __call__(self, x_BTD, rope_BTH, attend):
        """-> (x_BTD, the cache mode's per-layer output of `attend`)."""
        h_BTD, aux = self.self_attn(self.input_layernorm(x_BTD), rope_BTH, attend)
        x_BTD = sharding.constrain(x_BTD + h_BTD, X_AXES)
        return sharding.constrain(x_BTD + self.mlp(self.post_attention_layernorm(x_BTD)),
                                  X_AXES), aux


@dataclasses.dataclass(frozen=True)
class FullAttention:
    """Cache mode of a full causal forward over `valid_BT` (1: real token), with the
    model's attention kernel (`attention.attention`, `impl` a `model.attention` value);
    `finish` returns every layer's keys and values (k_LBTKH, v_LBTKH) if `keep_kv`, else
    None (a prefill writes them into its cache; a trainer keeps nothing). `segments`:
    packed rows, attention within each segment only (None: one sequence per row)."""

    valid_BT: jax.Array
    impl: str = "auto"
    keep_kv: bool = False
    interpret: bool = False
    segments: attention_lib.Segments | None = None
    remat = True

    def layer_xs(self, num_layers: int):
        return None

    def init(self):
        return None

    def attend(self, q_BTNH, k_BTKH, v_BTKH, xs_l, state):
        o_BTNH = attention_lib.attention(q_BTNH, k_BTKH, v_BTKH, self.valid_BT, impl=self.impl,
                                         segments=self.segments, interpret=self.interpret)
        return o_BTNH, None, (k_BTKH, v_BTKH) if self.keep_kv else None

    def finish(self, state, ys):
        return ys


def default_positions(valid_BT: jax.Array) -> jax.Array:
    """Each token's number of real tokens before it (left padding shifts nothing)."""
    return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, dtype, param_dtype) -> DecoderLayer:
    """One DecoderLayer whose parameters have a leading axis of cfg.num_layers layers, each
    initialised from its own split of `rngs`."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    return make(rngs)


class Qwen(nnx.Module):
    """Qwen2/2.5/3 causal LM; parameter paths mirror Hugging Face (without `model.`), with the
    decoder layers stacked on a leading axis (`layers.mlp.up_proj.kernel` [L, D, F])."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        cfg = self.config = config
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs,
                                  param_dtype=param_dtype)
        self.layers = _stacked_layers(cfg, rngs, dtype, param_dtype)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)
        self.lm_head = (None if cfg.use_tied_embeddings else
                        Linear((cfg.hidden_size,), (cfg.vocab_size,), axes=("embed", "vocab"),
                               use_bias=False, **kw))
        self.dtype = dtype

    def _embed(self, tokens_BT):
        # the table is read in its storage dtype (the gradient's scatter-add stays float32)
        x_BTD = jnp.take(self.embed_tokens.embedding[...], tokens_BT, axis=0).astype(self.dtype)
        return sharding.constrain(x_BTD, X_AXES)

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """The output head on final hidden states: norm, then projection -> float32 logits."""
        x_BTD = self.norm(x_BTD)
        if self.lm_head is None:
            logits_BTV = mm(x_BTD, self.embed_tokens.embedding[...], (1,),
                            w_logical=("vocab", "embed"))
        else:
            logits_BTV = mm(x_BTD, self.lm_head.kernel[...], (0,), w_logical=self.lm_head.axes)
        return sharding.constrain(logits_BTV, LOGITS_AXES)

    def full(self, valid_BT: jax.Array, *, keep_kv: bool = False,
             segments: attention_lib.Segments | None = None) -> FullAttention:
        """The full-forward cache mode with this model's kernel choice (`segments`: packed
        rows)."""
        return FullAttention(valid_BT.astype(bool), self.config.attention, keep_kv,
                             self.config.kernel_interpret, segments)

    def forward(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache: Any):
        """The decoder stack without the head, attention supplied by the cache mode `cache`
        -> (final hidden states x_BTD before the final norm, `cache.finish`'s result).
        `logits(x_BTD)` finishes the forward (a scorer that must not form all logits at
        once runs it on chunks of positions)."""
        cfg = self.config
        rope_BTH = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta)
        graphdef, layer_state = nnx.split(self.layers)

        def step(carry, xs):
            x_BTD, state = carry
            layer_state_l, xs_l = xs

            def attend(q_BTNH, k_BTKH, v_BTKH):
                o_BTNH, new_state, ys_l = cache.attend(q_BTNH, k_BTKH, v_BTKH, xs_l, state)
                return o_BTNH, (new_state, ys_l)

            layer = nnx.merge(graphdef, layer_state_l)
            x_BTD, (state, ys_l) = layer(x_BTD, rope_BTH, attend)
            return (x_BTD, state), ys_l

        policy = REMAT_POLICIES[cfg.remat] if cache.remat else None
        if policy is not None:
            step = jax.checkpoint(step, policy=policy, prevent_cse=False)
        carry = (self._embed(tokens_BT), cache.init())
        (x_BTD, state), ys = lax.scan(step, carry, (layer_state, cache.layer_xs(cfg.num_layers)),
                                      unroll=min(cfg.scan_unroll, cfg.num_layers))
        return x_BTD, cache.finish(state, ys)

    def hidden_states(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                      attn_mask_BT: jax.Array | None = None,
                      segments: attention_lib.Segments | None = None) -> jax.Array:
        """The full causal forward without the head -> x_BTD (before the final norm);
        mask, positions and segments as `__call__`'s."""
        B, T = tokens_BT.shape
        valid_BT = jnp.ones((B, T), bool) if attn_mask_BT is None else attn_mask_BT.astype(bool)
        if positions_BT is None:
            positions_BT = (default_positions(valid_BT) if segments is None else
                            segments_lib.positions(segments_lib.token_ids(valid_BT, segments)))
        return self.forward(tokens_BT, positions_BT, self.full(valid_BT, segments=segments))[0]

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 attn_mask_BT: jax.Array | None = None, *, logits_slice: slice | None = None,
                 segments: attention_lib.Segments | None = None):
        """Full causal forward -> float32 logits [B, T, V].

        `logits_slice` (a static slice of the T positions) returns only those positions'
        logits, [B, len(range(T)[logits_slice]), V]: the final norm and the output projection
        then run on those hidden states only (a trainer scoring responses skips the prompt
        positions, a next-token loss the last one).
        """
        x_BTD = self.hidden_states(tokens_BT, positions_BT, attn_mask_BT, segments)
        if logits_slice is not None:
            x_BTD = x_BTD[:, logits_slice]
        return self.logits(x_BTD)
