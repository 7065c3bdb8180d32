"""What a checkpoint records about its experiment, and the check a resume makes against it.

Every checkpoint's side-car holds the run's config (JSON) and a fingerprint of its prompts
(`data_fingerprint`: rows, a hash of the tokenized prompts and answers, and the source
file's size and content hash). A resume compares both with the run being started: a
changed key that changes the experiment is a one-line start-up error naming the keys and
both values (`check`); `config.resume_changed_config=True` continues anyway, and the
changes go into the first metrics line after the resume (`config_changes`).

Every key changes the experiment except the ones in `FREE` (logging, checkpointing,
where files are, how the same computation is laid out or chunked); docs/reliability.md
lists them. `num_train_steps` may change while no update so far would have had another
learning rate under the new length (a constant schedule; cosine within its warm-up): the
resumed run is then exactly the new config's uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from ba_jax.run_config import ConfigError

# Keys (or prefixes ending in ".") that may differ between a checkpoint and its resume.
FREE = (
    "log_every", "max_consecutive_nonfinite", "resume_changed_config", "checkpoint.",
    # paths: the data is compared by its fingerprint, the weights come from the checkpoint
    "data.path", "model.init_path", "tokenizer_path", "rollout.vllm_python",
    # the same computation laid out, chunked or scheduled differently
    "mesh.", "model.attention", "model.remat", "model.scan_unroll", "model.logits_chunk",
    "grpo.num_microbatches", "grpo.max_tokens_per_device",
    "rollout.num_slots", "rollout.page_size", "rollout.kv_pages",
    "rollout.prefill_chunk", "rollout.vllm_enforce_eager", "reward.num_workers",
    "reward.inline_dapo",
    # measured, not used: with engine log-probs a check recomputes and logs the mismatch only
    "grpo.logp_check_every",
)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _file_digest(path: str) -> tuple[int, str]:
    """(bytes, sha256) of a file, or of a folder's files in name order."""
    files = ([path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs))
    h, size = hashlib.sha256(), 0
    for name in files:
        if len(files) > 1:
            h.update(os.path.relpath(name, path).encode() + b"\0")
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                size += len(block)
    return size, h.hexdigest()


def data_fingerprint(prompt_set) -> dict[str, Any]:
    """Rows, a hash of what training reads (token ids and answers, in order), and the
    source's size and content hash (when it is a local file or folder)."""
    h = hashlib.sha256()
    for ids, truth in zip(prompt_set.prompt_ids, prompt_set.ground_truths):
        h.update(np.asarray(ids, np.int64).tobytes())
        h.update(b"\0" + truth.encode() + b"\0")
    out: dict[str, Any] = {"rows": len(prompt_set.prompt_ids), "prompts_sha256": h.hexdigest()}
    source = getattr(prompt_set, "source", "")
    if source and os.path.exists(source):
        out["file_bytes"], out["file_sha256"] = _file_digest(source)
    return out


def _free(key: str) -> bool:
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE)


def _same_past_learning_rates(old: dict, new: dict, updates_done: int) -> bool:
    """Whether every update so far had the learning rate the new run length gives it
    (optim.make_optimizer): always with a constant schedule; with cosine while all of them
    were in the warm-up, whose ramp does not depend on the length."""
    if new.get("optim.schedule") == "constant":
        return True
    return updates_done <= max(1, int(new.get("optim.warmup_steps", 1)))


def changes(saved_config: dict, config: dict, saved_data: dict | None, data: dict, *,
            updates_done: int = 0) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this run's value) of every experiment key that differs;
    the data fingerprint's fields as `data.<field>` (skipped for a checkpoint that holds
    none). A key only one side has (added or removed since) is not compared.
    `num_train_steps` counts when it changed a learning rate already used (`updates_done`
    optimizer updates so far)."""
    old, new = flatten(saved_config), flatten(config)
    out = [(k, old[k], new[k]) for k in sorted(set(old) & set(new))
           if old[k] != new[k] and not _free(k) and not (
               k == "num_train_steps" and _same_past_learning_rates(old, new, updates_done))]
    if saved_data is not None:
        out += [(f"data.{k}", saved_data.get(k), data.get(k)) for k in sorted(data)
                if k in saved_data and saved_data[k] != data[k]]
    return out


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 24 else text[:12] + "..." + text[-6:]


def describe(found: list[tuple[str, Any, Any]]) -> str:
    """'a.b: 1 -> 2; c: 'x' -> 'y'' (long values shortened)."""
    return "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in found)


def check(meta: dict, config: dict, data: dict, *, allow: bool, where: str) -> str:
    """Compare a checkpoint's side-car `meta` with this run's config (a plain dict) and data
    fingerprint: '' when nothing that changes the experiment differs, the changes (text for
    the metrics) when they do and `allow`, a ConfigError naming them otherwise."""
    saved = meta.get("config")
    if not saved:
        return ""
    g = config.get("grpo", {})
    done = int(meta.get("step", 0)) * int(g.get("num_updates", 1)) * int(
        g.get("num_minibatches", 1))
    found = changes(json.loads(saved) if isinstance(saved, str) else saved, config,
                    meta.get("data_fingerprint"), data, updates_done=done)
    if not found:
        return ""
    if allow:
        return describe(found)
    raise ConfigError(
        f"{where} holds another experiment than this run: {describe(found)}. Run it with the "
        "checkpoint's values, use another --workdir, or pass "
        "--config.resume_changed_config=True to continue with the new ones (recorded in "
        "metrics.jsonl)")
