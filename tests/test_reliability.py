"""Reliability: kill-anywhere resume, the non-finite guard, and a catalogue of bad inputs.

Every bad input must end in a clear message before the first step (naming the file, row,
key or option) or in a counted skip; never a traceback halfway through a run.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from ba_jax import build, checkpoint, data, experience, train, workdir_lock
from ba_jax.metrics import read_metrics
from ba_jax.run_config import ConfigError
from test_train import REPO, debug_config, params_of

sys.path.insert(0, os.path.join(REPO, "scripts"))
import kill_resume  # noqa: E402


# ----------------------------------------------------------------- non-finite guard


def _poison(monkeypatch, steps: set[int]):
    """Make the update batch of the given RL steps non-finite (old log-probs = NaN)."""
    real = experience.collect
    calls = {"n": 0}

    def collect(*args, **kwargs):
        exp = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] in steps:
            exp.batch["old_logp_BR"] = np.full_like(exp.batch["old_logp_BR"], np.nan)
        return exp

    monkeypatch.setattr(experience, "collect", collect)


def _ckpt_params(wd, step):
    cfg = debug_config(**{"mesh.data": 1})
    mesh = build.make_mesh(cfg, jax.devices()[:1])
    graphdef, params = build.init_policy(cfg, mesh)
    tx, _ = build.make_optimizer(cfg)
    ck = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"))
    state, _ = ck.restore(step, train.init_state(params, tx, mesh))
    ck.close()
    return jax.tree.leaves(jax.device_get(state))


def test_nonfinite_step_leaves_state_unchanged(tmp_path, monkeypatch):
    _poison(monkeypatch, {2})
    wd = str(tmp_path)
    cfg = debug_config(**{"num_train_steps": 3, "checkpoint.every_steps": 1,
                          "checkpoint.max_to_keep": 5})
    train.train_and_evaluate(cfg, wd)
    rows = read_metrics(wd)
    assert [r["nonfinite_updates"] for r in rows] == [0.0, 1.0, 0.0]
    s1, s2, s3 = (_ckpt_params(wd, s) for s in (1, 2, 3))
    for a, b in zip(s1, s2):  # parameters, optimizer state and update count untouched
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(s2, s3))  # and training goes on


def test_consecutive_nonfinite_steps_stop_with_intact_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, {2, 3, 4, 5})
    wd = str(tmp_path)
    cfg = debug_config(**{"num_train_steps": 8, "checkpoint.every_steps": 1,
                          "max_consecutive_nonfinite": 3})
    with pytest.raises(FloatingPointError, match="3 steps in a row"):
        train.train_and_evaluate(cfg, wd)
    step, leaves, meta = params_of(wd)
    assert step == 4 and meta["step"] == 4
    for a, b in zip(leaves, _ckpt_params(wd, 4)[: len(leaves)]):
        assert np.all(np.isfinite(a))
    assert [r["nonfinite_updates"] for r in read_metrics(wd)] == [0.0, 1.0, 1.0, 1.0]


# ----------------------------------------------------------------- bad inputs


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def _dataset_cfg(path, **overrides):
    return debug_config(**{"task": "dataset", "data.path": str(path), "data.template": "plain",
                           "data.format": "auto", **overrides})


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from ba_jax.tasks import arithmetic

    return arithmetic.save_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _good_rows(n=8):
    return [{"prompt": f"What is {i}+1? Answer:", "solution": str(i + 1)} for i in range(n)]


_GOOD_LINE = b'{"prompt": "What is 1+1? Answer:", "solution": "2"}\n'


def _cfg_case(overrides):
    return lambda tmp, tok: (debug_config(**overrides), str(tmp / "run"))


def _data_case(rows=None, raw=None, name="data.jsonl", tokenizer=None, **overrides):
    def make(tmp, tok):
        tok = tokenizer or tok
        path = tmp / name
        if raw is not None:
            path.write_bytes(raw)
        elif rows is not None:
            _jsonl(path, rows)
        cfg = _dataset_cfg(path, tokenizer_path=tok, **overrides)
        return cfg, str(tmp / "run")
    return make


_HELD_LOCKS: list[int] = []  # the "workdir in use" case's lock stays held to the end


def _tiny_hf(tmp) -> str:
    """A tiny Hugging Face Qwen3 folder (vocabulary 128): another model than any preset."""
    from helpers_hf import make_tiny_hf

    return make_tiny_hf(tmp / "hf", arch="qwen3", tie=True)


def _workdir_in_use(tmp, tok):
    """A workdir whose lock another run holds (here: another open file of this process)."""
    wd = tmp / "run"
    wd.mkdir()
    _HELD_LOCKS.append(workdir_lock.acquire(str(wd)))
    return debug_config(), str(wd)


BAD = [
    # (case id, builder, exception type, message pattern)
    ("unknown rule", _cfg_case({"grpo.aggregation": "balancd"}), ConfigError, "balanced_batch"),
    ("rule path missing module", _cfg_case({"grpo.aggregation": "no_such_pkg.mod:fn"}),
     ConfigError, "no_such_pkg"),
    ("mesh does not fit devices", _cfg_case({"mesh.data": 3}), ConfigError, "config.mesh"),
    ("two free mesh axes", _cfg_case({"mesh.data": -1, "mesh.fsdp": -1}), ConfigError, "at most one"),
    ("minibatches do not divide prompts", _cfg_case({"grpo.num_minibatches": 3}), ConfigError,
     "num_minibatches"),
    ("microbatches do not divide rows", _cfg_case({"grpo.num_microbatches": 3}), ConfigError,
     "num_microbatches"),
    ("rows not divisible by devices", _cfg_case({"grpo.num_microbatches": 4}), ConfigError,
     "data\\*fsdp"),
    ("unknown advantage", _cfg_case({"grpo.advantage": "ppo"}), ConfigError, "grpo.advantage"),
    ("unknown kl kind", _cfg_case({"grpo.kl_kind": "k4"}), ConfigError, "kl_kind"),
    ("unknown attention kernel", _cfg_case({"model.attention": "flash"}), ConfigError,
     "config.model.attention='flash'; valid: auto, xla, chunked, cudnn, splash"),
    ("unknown remat policy", _cfg_case({"model.remat": "some"}), ConfigError,
     "config.model.remat='some'"),
    ("scan unroll below one", _cfg_case({"model.scan_unroll": 0}), ConfigError,
     "config.model.scan_unroll=0"),
    ("bad dtype", _cfg_case({"model.dtype": "float16"}), ConfigError, "dtype"),
    ("top_p zero", _cfg_case({"rollout.top_p": 0.0}), ConfigError, "top_p"),
    ("negative temperature", _cfg_case({"rollout.temperature": -1.0}), ConfigError, "temperature"),
    ("zero samples", _cfg_case({"rollout.num_samples": 0}), ConfigError, "num_samples"),
    ("unknown init", _cfg_case({"model.init": "pretrained"}), ConfigError, "model.init"),
    ("init folder missing", _cfg_case({"model.init": "hf", "model.init_path": "/nonexistent/qwen"}),
     ConfigError, "/nonexistent/qwen"),
    ("unknown preset", _cfg_case({"model.preset": "Qwen9-1B"}), ConfigError, "Qwen9-1B"),
    ("unknown preset lists the names", _cfg_case({"model.preset": "qwen9-1b"}), ConfigError,
     r"config.model.preset='qwen9-1b'; valid \(in any letter case\): Qwen2\.5-0\.5B, .*Qwen3-8B"),
    ("heads not multiple of kv heads", _cfg_case({"model.num_kv_heads": 3}), ConfigError,
     "num_kv_heads"),
    ("unknown task", _cfg_case({"task": "chess"}), ConfigError, "config.task"),
    ("unknown schedule", _cfg_case({"optim.schedule": "linear"}), ConfigError, "schedule"),
    ("zero learning rate", _cfg_case({"optim.learning_rate": 0.0}), ConfigError, "learning_rate"),
    ("zero checkpoint interval", _cfg_case({"checkpoint.every_steps": 0}), ConfigError,
     "every_steps"),
    ("dataset file missing", _data_case(name="absent.jsonl"), ConfigError, "absent.jsonl"),
    ("dataset file empty", _data_case(raw=b""), ConfigError, "empty"),
    ("dataset missing columns", _data_case(rows=[{"question": "q", "x": 1}] * 4), ConfigError,
     "data.jsonl"),
    ("dataset not JSON", _data_case(raw=b"{not json\n"), ConfigError, "data.jsonl"),
    ("dataset invalid UTF-8", _data_case(raw=b'{"prompt": "\xff\xfe Answer:", "solution": "1"}\n'),
     ConfigError, "data.jsonl"),
    # issue 37 item 10: the line, and `{}` rows
    ("dataset line 2 not JSON", _data_case(raw=_GOOD_LINE + b'{"prompt": "x", "solution": \n'
                                           + _GOOD_LINE), ConfigError,
     r"could not read data file .*data.jsonl: line 2 is not valid JSON \(Expecting value at "
     r"column 29\)"),
    ("dataset line 3 not UTF-8", _data_case(raw=_GOOD_LINE * 2 + b'{"prompt": "\xff"}\n'),
     ConfigError, r"data.jsonl: line 3 is not UTF-8 \(invalid start byte at byte 12\)"),
    ("dataset line 2 not an object", _data_case(raw=_GOOD_LINE + b"[1, 2]\n"), ConfigError,
     r"data.jsonl: line 2 is a JSON list, not an object"),
    ("dataset rows all {}", _data_case(raw=b"{}\n{}\n\n{}\n"), ConfigError,
     r"data.jsonl: every one of its 3 rows is an empty object \{\}"),
    ("dataset wrong suffix", _data_case(rows=_good_rows(), name="data.csv"), ConfigError, "data.csv"),
    ("parquet file corrupt", _data_case(raw=b"PAR1garbage", name="data.parquet"), ConfigError,
     "data.parquet"),
    ("every prompt too long", _data_case(rows=_good_rows(), **{"data.max_prompt_tokens": 2}),
     ConfigError, "too_long"),
    ("unknown data format", _data_case(rows=_good_rows(), **{"data.format": "gsm8k"}),
     ConfigError, "format"),
    ("dataset without tokenizer", lambda tmp, tok: (
        _dataset_cfg(_jsonl(tmp / "d.jsonl", _good_rows())), str(tmp / "run")),
     ConfigError, "tokenizer_path"),
    ("tokenizer folder missing", _data_case(rows=_good_rows(), tokenizer="/nonexistent/tok"),
     ConfigError, "/nonexistent/tok"),
    ("chat template missing", _data_case(rows=_good_rows(), **{"data.template": "chat"}),
     ConfigError, "template"),
    ("one sample per prompt", _cfg_case({"rollout.num_samples": 1}), ConfigError,
     r"config.rollout.num_samples=1: GRPO needs >= 2 samples per prompt"),
    ("negative eps_low", _cfg_case({"grpo.eps_low": -0.1}), ConfigError, "config.grpo.eps_low"),
    ("negative eps_high", _cfg_case({"grpo.eps_high": -0.1}), ConfigError, "eps_high=-0.1"),
    ("zero train steps", _cfg_case({"num_train_steps": 0}), ConfigError,
     "config.num_train_steps=0 must be >= 1"),
    ("negative top_k", _cfg_case({"rollout.top_k": -1}), ConfigError, "config.rollout.top_k=-1"),
    ("negative engine slots", _cfg_case({"rollout.num_slots": -1}), ConfigError,
     "config.rollout.num_slots=-1 must be >= 0"),
    ("zero page size", _cfg_case({"rollout.page_size": 0}), ConfigError,
     "config.rollout.page_size=0 must be >= 1"),
    ("kv pool smaller than one sequence", _cfg_case({"rollout.num_slots": 4,
                                                     "rollout.page_size": 2,
                                                     "rollout.kv_pages": 1}),
     ConfigError, r"config.rollout.kv_pages=1 cannot hold one sequence"),
    ("kl kind without beta", _cfg_case({"grpo.kl_kind": "k3"}), ConfigError,
     r"config.grpo.kl_kind='k3' needs config.grpo.kl_beta > 0 \(got 0.0\)"),
    ("kl beta without kind", _cfg_case({"grpo.kl_beta": 0.1}), ConfigError,
     r"config.grpo.kl_beta=0.1 has no effect with config.grpo.kl_kind='none'"),
    ("negative logits chunk", _cfg_case({"model.logits_chunk": -1}), ConfigError,
     "config.model.logits_chunk=-1 must be an integer >= 0"),
    ("rows past the model's positions", _cfg_case({"model.max_position_embeddings": 32}),
     ConfigError, r"rows need \d+ positions .*max_position_embeddings=32: shorten them, or set "
     r"config.model.position_limit="),
    ("custom rule raises", _cfg_case({"grpo.aggregation": "custom_rules:raises"}), ConfigError,
     "config.grpo.aggregation='custom_rules:raises' fails on .*RuntimeError: this rule is broken"),
    ("custom rule without options", _cfg_case({"grpo.aggregation": "custom_rules:no_options"}),
     ConfigError, r"config.grpo.aggregation=.*no_options.*declare \*\*options"),
    ("custom rule wrong shape", _cfg_case({"grpo.aggregation": "custom_rules:wrong_shape"}),
     ConfigError, r"config.grpo.aggregation=.*returned shape \(2,\) .*expected"),
    ("custom rule returns None", _cfg_case({"grpo.aggregation": "custom_rules:returns_none"}),
     ConfigError, "config.grpo.aggregation=.*returned None"),
    ("custom rule not finite", _cfg_case({"grpo.aggregation": "custom_rules:not_finite"}),
     ConfigError, "config.grpo.aggregation=.*non-finite weights"),
    ("zero prompt tokens", _cfg_case({"data.max_prompt_tokens": 0}), ConfigError,
     "config.data.max_prompt_tokens=0"),
    ("chat template for arithmetic", _cfg_case({"data.template": "chat"}), ConfigError,
     "config.data.template='chat' applies to task=dataset only"),
    ("tokenizer larger than vocabulary", _cfg_case({"model.vocab_size": 64}), ConfigError,
     r"has 101 tokens \(largest id 100.*vocabulary has 64 \(config.model.vocab_size\)"),
    ("checkpoint folder without tokenizer", lambda tmp, tok: (_dataset_cfg(
        _jsonl(tmp / "d.jsonl", _good_rows()), **{"model.init": "checkpoint",
                                                  "model.init_path": str(tmp)}), str(tmp / "run")),
     ConfigError, "config.tokenizer_path is required .*holds no tokenizer.json"),
    ("workdir under a file", lambda tmp, tok: (debug_config(), str(_jsonl(tmp / "f", [])) + "/run"),
     ConfigError, "workdir"),
    ("workdir in use by another run", _workdir_in_use, ConfigError,
     r"--workdir=.* is in use by another run \(pid \d+ on host \S+, started"),
    # issue 37 items 6, 7, 10: runs that would never learn, or fail late
    ("overlong buffer past the budget", _cfg_case({"grpo.overlong_buffer": 9}), ConfigError,
     r"config.grpo.overlong_buffer=9 is larger than config.rollout.max_new_tokens=8: .* or 0"),
    ("greedy temperature in training", _cfg_case({"rollout.temperature": 0.0}), ConfigError,
     r"config.rollout.temperature=0.0 samples greedily: .* use temperature > 0"),
    ("greedy top_k in training", _cfg_case({"rollout.top_k": 1}), ConfigError,
     r"config.rollout.top_k=1 samples greedily"),
    ("bfloat16 params with a tiny learning rate",
     _cfg_case({"model.param_dtype": "bfloat16", "optim.learning_rate": 1e-6}), ConfigError,
     r"config.model.param_dtype=bfloat16 with config.optim.learning_rate=1e-06: .* use "
     r"config.model.param_dtype=float32"),
    ("dual clip below one", _cfg_case({"grpo.dual_clip": 0.5}), ConfigError,
     r"config.grpo.dual_clip=0.5 must be > 1 \(or 0: off\)"),
    ("dual clip of one", _cfg_case({"grpo.dual_clip": 1.0}), ConfigError,
     r"config.grpo.dual_clip=1.0 must be > 1"),
    ("preset other than the weights' model", lambda tmp, tok: (debug_config(**{
        "model.preset": "Qwen3-0.6B", "model.init": "hf",
        "model.init_path": _tiny_hf(tmp)}), str(tmp / "run")), ConfigError,
     r"config.model.preset='Qwen3-0.6B' but config.model.init_path=.* holds another model "
     r"\(vocab_size 128 \(preset 151936\), hidden_size .*clear config.model.preset"),
    ("adam b2 above one", _cfg_case({"optim.b2": 1.5}), ConfigError,
     r"config.optim.b2=1.5 must be in \[0, 1\)"),
    ("adam b1 negative", _cfg_case({"optim.b1": -0.1}), ConfigError,
     r"config.optim.b1=-0.1 must be in \[0, 1\)"),
    ("final lr fraction above one", _cfg_case({"optim.final_lr_fraction": 1.5}), ConfigError,
     r"config.optim.final_lr_fraction=1.5 must be in \[0, 1\]"),
    ("final lr fraction negative", _cfg_case({"optim.final_lr_fraction": -0.1}), ConfigError,
     r"config.optim.final_lr_fraction=-0.1 must be in \[0, 1\]"),
    ("eps_low of one", _cfg_case({"grpo.eps_low": 1.0}), ConfigError,
     r"config.grpo.eps_low=1.0 must be < 1"),
    ("cudnn without a GPU", _cfg_case({"model.attention": "cudnn"}), ConfigError,
     r"config.model.attention='cudnn' needs an NVIDIA GPU and config.model.dtype=bfloat16; "
     r"this run has jax backend 'cpu'"),
    ("splash without a TPU", _cfg_case({"model.attention": "splash"}), ConfigError,
     r"config.model.attention='splash' needs a TPU; this run has jax backend 'cpu'"),
    ("vllm with heads of 8", _cfg_case({"rollout.engine": "vllm"}), ConfigError,
     r"config.rollout.engine=vllm: the model's head size 8 \(head_dim\) is not one "
     r"vLLM-CPU's attention takes \(32, 64, .*rollout.engine=paged"),
    ("negative resample rounds", _cfg_case({"grpo.max_resample_rounds": -1,
                                            "grpo.dynamic_sampling": True}), ConfigError,
     r"config.grpo.max_resample_rounds=-1 must be >= 0"),
    ("unknown arithmetic operator", _cfg_case({"arithmetic.ops": "x"}), ConfigError,
     r"config.arithmetic.ops='x': a string of the operators '\+-\*'"),
]


@pytest.mark.parametrize("name,make,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_startup_error(tmp_path, char_tokenizer, name, make, exc, pattern):
    cfg, wd = make(tmp_path, char_tokenizer)
    with pytest.raises(exc, match=pattern):
        train.train_and_evaluate(cfg, wd)
    assert not os.path.exists(os.path.join(wd, "metrics.jsonl"))  # failed before any step


def test_valid_custom_rule_trains(tmp_path):
    wd = str(tmp_path)
    train.train_and_evaluate(debug_config(**{"num_train_steps": 1,
                                             "grpo.aggregation": "custom_rules:per_sequence"}), wd)
    assert [r["step"] for r in read_metrics(wd)] == [1]


def test_every_builtin_rule_passes_the_startup_check():
    from ba_jax import aggregation

    for rule in aggregation.RULES:
        for degenerate in (True, False):
            aggregation.check_rule(rule, max_len=8, count_degenerate_groups=degenerate)


def test_special_ids_past_the_vocabulary_are_named():
    class Tok:  # 10 tokens, but an EOS id far past them
        pad_token_id, all_special_ids, name_or_path = 0, [0, 70], "tok"

        def __len__(self):
            return 10

        def get_vocab(self):
            return {str(i): i for i in range(10)}

    cfg = debug_config()
    build.check_tokenizer_fits(cfg, Tok(), 101, [70])  # fits a vocabulary of 101
    with pytest.raises(ConfigError, match=r"largest id 70; EOS id 70, special id 70\) but the "
                       r"model's vocabulary has 64 \(config.model.vocab_size\)"):
        build.check_tokenizer_fits(cfg, Tok(), 64, [70])


def test_checkpoint_folder_from_convert_hf_brings_its_tokenizer(tmp_path, char_tokenizer):
    import shutil

    from ba_jax import run_config
    from ba_jax.models import convert_hf
    from helpers_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", arch="qwen3", tie=True)  # vocabulary of 128
    for name in os.listdir(char_tokenizer):
        shutil.copy(os.path.join(char_tokenizer, name), hf)
    out = str(tmp_path / "ckpt")
    convert_hf.main(["--hf", hf, "--out", out])
    cfg = _dataset_cfg(_jsonl(tmp_path / "d.jsonl", _good_rows()),
                       **{"model.init": "checkpoint", "model.init_path": out})
    assert not cfg.tokenizer_path
    run_config.validate(cfg, len(jax.devices()))
    tok = build.load_tokenizer(cfg, str(tmp_path / "run"))
    assert os.path.samefile(tok.name_or_path, out) and len(tok) == 101
    build.check_tokenizer_fits(cfg, tok, 128, train._eos_ids(tok))


def test_bad_rows_are_skipped_and_counted(tmp_path, char_tokenizer):
    from transformers import AutoTokenizer

    rows = _good_rows(6) + [
        {"prompt": "", "solution": "1"},  # empty prompt
        {"prompt": 7, "solution": "1"},  # mistyped prompt
        {"prompt": "x" * 100_000 + " Answer:", "solution": "1"},  # enormous row
        {"prompt": "What is 0+1? Answer:", "solution": "1"},  # duplicate of row 0
        {}, {},  # empty rows (issue 37: counted under their own name)
    ]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(char_tokenizer)
    ds = data.load_prompts(data.DataConfig(path=path, template="plain", max_prompt_tokens=64), tok)
    assert len(ds.prompt_ids) == 6
    assert ds.stats["too_long"] == 1 and ds.stats["duplicates_dropped"] == 1
    assert ds.stats["empty_prompt"] + ds.stats["malformed"] == 2 and ds.stats["empty_row"] == 2
    assert ds.stats["rows_read"] == len(rows)


def test_checkpoint_of_another_model_shape_is_named(tmp_path):
    wd = str(tmp_path)
    train.train_and_evaluate(debug_config(num_train_steps=1), wd)
    with pytest.raises(checkpoint.CheckpointError, match=os.path.join(wd, "checkpoints")):
        train.train_and_evaluate(debug_config(**{"num_train_steps": 2, "model.hidden_size": 48,
                                                 "resume_changed_config": True}), wd)


def test_weights_folder_with_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    from helpers_hf import make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf", arch="qwen3", tie=True)
    weights = load_file(os.path.join(hf, "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    cfg = debug_config(**{"model.init": "hf", "model.init_path": hf})
    with pytest.raises(ConfigError, match="layers.1.mlp.up_proj"):
        train.train_and_evaluate(cfg, str(tmp_path / "run"))


def test_full_disk_at_save_stops_cleanly_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    wd = str(tmp_path)
    real_save = checkpoint.Checkpointer.save

    def save(self, step, state, meta):
        if step == 2:
            raise OSError(28, "No space left on device")
        return real_save(self, step, state, meta)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    cfg = debug_config(**{"num_train_steps": 3, "checkpoint.every_steps": 1})
    with pytest.raises(checkpoint.CheckpointError, match="No space left.*step 1\\) is intact"):
        train.train_and_evaluate(cfg, wd)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", real_save)
    train.train_and_evaluate(cfg, wd)  # space is back: resumes from step 1 and finishes
    assert [r["step"] for r in read_metrics(wd)] == [1, 2, 3]


# ----------------------------------------------------------------- walls of text (issue 22 item 9)


def _errors(stderr: str) -> list[str]:
    """The lines of a command's stderr a user reads after it stops: progress-bar redraws
    (tqdm's carriage returns) reduced to their last state, the bar itself and blanks dropped."""
    lines = [line.split("\r")[-1].rstrip() for line in stderr.split("\n")]
    return [line for line in lines if line and not re.match(r"^train( stopped)?:\s+\d+%", line)]


def _command(module, *args, wrapper=None, cwd=REPO, timeout=300):
    """`python -m module args` (or `python -c wrapper args`, which runs it), as a user would."""
    head = ["-c", wrapper] if wrapper else ["-m", module]
    return subprocess.run([sys.executable, *head, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# Runs ba_jax.main with Orbax's array writes failing as TensorStore fails on a full disk:
# a ValueError carrying os_error_code='28', after an ERROR log from a writer thread.
_FULL_DISK = """
import logging, runpy, sys
import orbax.checkpoint as ocp
real = ocp.CheckpointManager.save
def save(self, step, *args, **kwargs):
    if step == 2:
        logging.getLogger("absl").error("_SignalingThread.run() raised an exception: "
                                        "RESOURCE_EXHAUSTED: Error writing ...")
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.mu" in OCDBT database '
                         'at local file "...": Failed to write 21300 bytes to file 22: No space '
                         "left on device [os_error_code='28']")
    return real(self, step, *args, **kwargs)
ocp.CheckpointManager.save = save
sys.argv = ["ba_jax.main"] + sys.argv[1:]
runpy.run_module("ba_jax.main", run_name="__main__")
"""

# Fills the tmpfs the workdir lies on just before step 2's save, so the save fails for real.
_FILL_DISK = """
import os, runpy, sys
from ba_jax import checkpoint
real = checkpoint.Checkpointer.save
def save(self, step, *args, **kwargs):
    if step == 2:
        with open(os.path.join(os.path.dirname(self.directory), "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"0" * (1 << 16))
                    f.flush()
            except OSError:
                pass
    return real(self, step, *args, **kwargs)
checkpoint.Checkpointer.save = save
sys.argv = ["ba_jax.main"] + sys.argv[1:]
runpy.run_module("ba_jax.main", run_name="__main__")
"""


# Step 2's metrics line fails as a write to a full disk does (the OSError of its flush).
# (A real full tmpfs is not used: a short line usually still fits the file's last page, and
# then tensorboardX's writer thread, dead of ENOSPC, blocks the run: see docs/reliability.md.)
_FULL_DISK_MID_STEP = """
import errno, os, runpy, sys
from ba_jax import metrics
real = metrics.MetricsWriter.write
def write(self, step, *args, **kwargs):
    if step == 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, step, *args, **kwargs)
metrics.MetricsWriter.write = write
sys.argv = ["ba_jax.main"] + sys.argv[1:]
runpy.run_module("ba_jax.main", run_name="__main__")
"""


def test_full_disk_mid_step_names_the_checkpoint_to_resume_from(tmp_path):
    """Issue 37 item 10: a disk that fills in the middle of a step (here at its metrics line)
    ended in a bare `ba_jax: [Errno 28] No space left on device`."""
    wd = str(tmp_path / "w")
    proc = _command(None, *MAIN, f"--workdir={wd}", wrapper=_FULL_DISK_MID_STEP)
    lines = _errors(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr[-3000:]
    assert re.fullmatch(r"ba_jax: \[Errno 28\] No space left on device: writing to "
                        r"--workdir='.*/w' failed during the run; the newest checkpoint \(step "
                        r"0 in .*/w/checkpoints\) is intact: free disk space and run the same "
                        r"command again to resume from it", lines[0]), lines[0]
    assert lines[1] == f"  (full detail in {wd}/error.log; --verbose prints it)"
    assert "OSError: [Errno 28]" in open(os.path.join(wd, "error.log")).read()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A debug-config workdir trained for 1 step (checkpoints 0 and 1)."""
    wd = str(tmp_path_factory.mktemp("trained"))
    train.train_and_evaluate(debug_config(num_train_steps=1), wd)
    return wd


def _copy_of(trained_run, tmp):
    wd = str(tmp / "run")
    shutil.copytree(trained_run, wd)
    return wd


MAIN = ("--config=configs/default.py:debug",)
# (case id, command arguments given (tmp, trained run), stderr pattern of the first line,
# whether a second line names the detail). Before (the new user's trial): a misspelled key
# 55-57 lines, a missing config file 39-41, a full disk 120-317, a changed model resumed
# with fallback_to_previous 4-707 (one line per array and per finalised coroutine).
WALLS = [
    ("misspelled config key", lambda tmp, run: ("ba_jax.main", *MAIN, f"--workdir={tmp}/w",
                                                "--config.grpo.agregation=token"),
     r"^ba_jax: --config.grpo.agregation=token: config.grpo has no key 'agregation'; did you "
     r"mean 'aggregation'\?", False),
    ("misspelled config section", lambda tmp, run: ("ba_jax.main", *MAIN, f"--workdir={tmp}/w",
                                                    "--config.gropo.aggregation=token"),
     r"^ba_jax: --config.gropo.aggregation=token: config has no key 'gropo'; did you mean "
     r"'grpo'\?", False),
    ("missing config file", lambda tmp, run: ("ba_jax.main", "--config=configs/nope.py",
                                              f"--workdir={tmp}/w"),
     r"^ba_jax: --config: the config file cannot be read: \[Errno 2\] No such file or "
     r"directory: 'configs/nope.py'", False),
    ("unknown config variant", lambda tmp, run: ("ba_jax.main", "--config=configs/default.py:x",
                                                 f"--workdir={tmp}/w"),
     r"^ba_jax: --config=configs/default.py:x: configs/default.py: unknown variant 'x'", False),
    ("changed model with fallback_to_previous", lambda tmp, run: (
        "ba_jax.main", *MAIN, f"--workdir={_copy_of(run, tmp)}", "--config.num_train_steps=3",
        "--config.model.hidden_size=48", "--config.checkpoint.fallback_to_previous=True",
        "--config.resume_changed_config=True"),
     r"^ba_jax: none of the checkpoints in .*/run/checkpoints \(steps 1, 0\) can be restored "
     r"into this run's state \(step 1: its params.embed_tokens.embedding has shape \(101, 32\), "
     r"this run's model \(101, 48\)\); .*use the config they were written with", True),
    ("changed model without fallback", lambda tmp, run: (
        "ba_jax.main", *MAIN, f"--workdir={_copy_of(run, tmp)}", "--config.num_train_steps=3",
        "--config.model.num_layers=2", "--config.resume_changed_config=True"),
     r"^ba_jax: checkpoint .*/run/checkpoints/1 cannot be restored into this run's state: its "
     r"params.layers.\S+ has shape \(1, .*this run's model \(2, ", True),
    ("changed model refused", lambda tmp, run: (
        "ba_jax.main", *MAIN, f"--workdir={_copy_of(run, tmp)}", "--config.num_train_steps=3",
        "--config.model.num_layers=2"),
     r"^ba_jax: checkpoint 1 in .*/run/checkpoints holds another experiment than this run: "
     r"model.num_layers: 1 -> 2\. ", False),
]


@pytest.mark.parametrize("name,args,pattern,detail", WALLS, ids=[w[0] for w in WALLS])
def test_an_error_is_one_or_two_lines(tmp_path, trained_run, name, args, pattern, detail):
    module, *argv = args(tmp_path, trained_run)
    proc = _command(module, *argv)
    lines = _errors(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1 + detail, proc.stderr[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    if detail:  # the detail is in the workdir's error.log, named on the second line
        log = os.path.join(tmp_path, "run", "error.log")
        assert lines[1] == f"  (full detail in {log}; --verbose prints it)"
        assert "Traceback (most recent call last)" in open(log).read()
        verbose = _errors(_command(module, *argv, "--verbose").stderr)
        assert len(verbose) > 10 and re.search(pattern, verbose[-1])  # the traceback, then it


@pytest.mark.parametrize("kind", ["tensorstore error", "real full tmpfs"])
def test_full_disk_at_save_is_two_lines_and_the_bar_is_not_complete(tmp_path, kind):
    wd = str(tmp_path / "w")
    argv = [*MAIN, f"--workdir={wd}"]
    if kind == "tensorstore error":
        proc = _command(None, *argv, wrapper=_FULL_DISK)
    else:
        os.makedirs(wd)
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True) if shutil.which(
            "unshare") else None
        if probe is None or probe.returncode != 0:
            pytest.skip("this machine cannot mount a private tmpfs (unshare -rm)")
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=32m tmpfs "$0" && exec "$@"', wd, sys.executable, "-c", _FILL_DISK, *argv],
            cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = _errors(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 2, proc.stderr[-3000:]
    assert re.fullmatch(r"ba_jax: saving checkpoint step 2 in .*/w/checkpoints failed \(\[Errno 28\] "
                        r"No space left on device\); the previous checkpoint \(step 0\) is "
                        r"intact: fix the cause and run again to resume from it", lines[0]), lines[0]
    assert "--verbose" in lines[1]
    bar = [seg for seg in proc.stderr.replace("\r", "\n").split("\n") if "it/s" in seg or "s/it" in seg]
    assert bar and "train stopped" in bar[-1] and "100%" not in proc.stderr


def test_a_failed_save_stops_the_run_and_names_the_cause(tmp_path, monkeypatch, capfd):
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 3:
            raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device "
                             "[os_error_code='28']")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    wd = str(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 3 .* failed \(\[Errno 28\] No "
                       r"space left on device\); the previous checkpoint \(step 2\) is intact"):
        train.train_and_evaluate(debug_config(), wd)
    err = capfd.readouterr().err
    assert "train stopped" in err and "100%" not in err  # the bar does not claim the last step
    assert [r["step"] for r in read_metrics(wd)] == [1, 2, 3]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real)
    assert "run complete" not in train.train_and_evaluate(debug_config(), wd)  # step 3 is redone
    assert [r["step"] for r in read_metrics(wd)] == [1, 2, 3]


def test_resume_of_another_model_with_fallback_names_the_array(trained_run, tmp_path):
    wd = _copy_of(trained_run, tmp_path)
    cfg = debug_config(**{"model.hidden_size": 48, "checkpoint.fallback_to_previous": True,
                          "resume_changed_config": True})
    with pytest.raises(checkpoint.CheckpointError) as info:
        train.train_and_evaluate(cfg, wd)
    assert "\n" not in str(info.value)
    assert re.fullmatch(r"none of the checkpoints in .*checkpoints \(steps 1, 0\) can be restored "
                        r"into this run's state \(step 1: its params.embed_tokens.embedding has "
                        r"shape \(101, 32\), this run's model \(101, 48\)\); they come from another "
                        r"model shape or are damaged: use the config they were written with, or "
                        r"another --workdir \(nothing was moved\)", str(info.value))
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["0", "1"]
    assert any("Requested shape" in note for note in info.value.__notes__)  # Orbax's own words


# ----------------------------------------------------------------- names and docs (item 11)


def test_presets_are_found_in_any_letter_case():
    from ba_jax import run_config
    from ba_jax.models import qwen

    for name in ("qwen3-0.6b", "QWEN3-0.6B", "Qwen3-0.6B"):
        cfg = debug_config(**{"model.preset": name, "mesh.data": 1})
        run_config.validate(cfg, 1)
        mc = run_config.model_config(cfg)
        assert mc.hidden_size == qwen.PRESETS["Qwen3-0.6B"].hidden_size
    import importlib.util  # configs/paper.py's lower-case model names resolve too

    spec = importlib.util.spec_from_file_location("paper", os.path.join(REPO, "configs", "paper.py"))
    paper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paper)
    for lower in paper.MODELS:
        assert run_config.preset_name(lower) == paper.MODELS[lower][0]


def test_bfloat16_learning_rate_rule_matches_adamw_rounding():
    """The rule behind `run_config.BF16_MIN_LR`: one AdamW step (of size lr, as its first
    step is) on bfloat16 weights of size 0.02 moves fewer than half of them at half the
    threshold, more than half at twice it, and 2% at the paper's lr 1e-6."""
    import jax.numpy as jnp

    from ba_jax import run_config

    w = jnp.asarray(np.random.default_rng(0).normal(0, 0.02, 100_000), jnp.bfloat16)

    def moved(lr):
        return float(((w.astype(jnp.float32) - lr).astype(jnp.bfloat16) != w).mean())

    assert moved(run_config.BF16_MIN_LR / 2) < 0.5 < moved(run_config.BF16_MIN_LR * 2)
    assert moved(1e-6) < 0.05
    cfg = debug_config(**{"model.param_dtype": "bfloat16"})
    for lr in (run_config.BF16_MIN_LR, 1.5e-3):  # at and above it: accepted
        cfg.optim.learning_rate = lr
        run_config.check_learning(cfg)


def test_accelerator_kernels_pass_where_the_seam_would_pick_them(monkeypatch):
    """`model.attention=cudnn` on a GPU in bf16, `splash` on a TPU: the check follows the
    kernel seam's `auto` rule (attention.resolve), so a machine that has them passes."""
    import jax

    from ba_jax import run_config

    for backend, impl, dtype, ok in [("gpu", "cudnn", "bfloat16", True),
                                     ("gpu", "cudnn", "float32", False),
                                     ("tpu", "splash", "float32", True),
                                     ("gpu", "splash", "bfloat16", False),
                                     ("cpu", "chunked", "float32", True)]:
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        cfg = debug_config(**{"model.attention": impl, "model.dtype": dtype})
        if ok:
            run_config.check_attention(cfg)
        else:
            with pytest.raises(ConfigError, match=f"config.model.attention='{impl}' needs"):
                run_config.check_attention(cfg)


def test_preset_with_the_same_model_in_init_path_passes(tmp_path):
    from ba_jax import run_config
    from ba_jax.models import hf_table, qwen

    hf = tmp_path / "qwen3-0.6b"
    hf.mkdir()
    with open(hf / "config.json", "w") as f:
        json.dump(hf_table.hf_config(qwen.PRESETS["Qwen3-0.6B"], "bfloat16"), f)
    cfg = debug_config(**{"model.preset": "qwen3-0.6b", "model.init": "hf",
                          "model.init_path": str(hf)})
    run_config.check_preset_matches_weights(cfg)  # the same model: no error
    cfg.model.preset = "Qwen3-1.7B"
    with pytest.raises(ConfigError, match=r"hidden_size 1024 \(preset 2048\)"):
        run_config.check_preset_matches_weights(cfg)


def _config_variants():
    """Every config file and variant in configs/ (paper: the whole 2 x 2 x 3 grid)."""
    import importlib.util

    path = os.path.join(REPO, "configs", "paper.py")
    spec = importlib.util.spec_from_file_location("paper", path)
    paper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paper)
    yield from (f"configs/default.py{v}" for v in ("", ":debug", ":head32"))
    for model in paper.MODELS:
        for dataset in paper.DATA:
            for agg in ("sequence", "token", "balanced"):
                yield f"configs/paper.py:model={model},data={dataset},agg={agg}"
    for setting in ("small_gap", "large_gap", "large_variation", "short_wrong", "debug"):
        yield f"configs/length_study.py:{setting}"


@pytest.mark.parametrize("spec", list(_config_variants()))
def test_every_shipped_config_passes_the_startup_checks(spec, tmp_path, monkeypatch):
    """The new checks refuse none of the configs that ship (their files and folders, which
    a user supplies, are stood in for by empty ones)."""
    from ba_jax import run_config

    monkeypatch.chdir(tmp_path)  # length_study's paths are relative to the repo's runs/
    cfg = run_config.load_config(os.path.join(REPO, spec))
    if cfg.task == "dataset":
        data_file = tmp_path / os.path.basename(cfg.data.path or "data.parquet")
        data_file.write_text("")
        cfg.data.path = str(data_file)
        cfg.tokenizer_path = cfg.tokenizer_path or str(tmp_path)
    if cfg.model.init != "random":
        folder = tmp_path / "weights"
        folder.mkdir(exist_ok=True)
        cfg.model.init_path = str(folder)
    run_config.validate(cfg, len(jax.devices()))


def test_plot_titles_say_they_are_moving_averages(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from ba_jax import plot

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "reward_mean": 0.1 * step, "accuracy": 0.5}) + "\n")
    titles, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (titles.append(fig.axes[0].get_title()),
                                                   close(fig)))
    plot.plot_runs([str(tmp_path)], str(tmp_path / "plots"))
    plot.plot_runs([str(tmp_path)], str(tmp_path / "raw"), window=1)
    assert titles == ["reward (mean over responses)\ntrailing 10-step moving average",
                      "accuracy (fraction judged right)\ntrailing 10-step moving average",
                      "reward (mean over responses)\nper-step values",
                      "accuracy (fraction judged right)\nper-step values"]


def test_plot_labels_runs_by_their_shortest_unique_path_suffix(tmp_path, monkeypatch):
    """Issue 37 item 8: `a/run` and `b/run` were one curve (keyed by the folder name)."""
    import matplotlib.pyplot as plt

    from ba_jax import plot

    runs = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c" / "other"]
    for i, wd in enumerate(runs):
        wd.mkdir(parents=True)
        with open(wd / "metrics.jsonl", "w") as f:
            for step in range(1, 4):
                f.write(json.dumps({"step": step, "reward_mean": i + 0.1 * step}) + "\n")
    legends, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (legends.append(
        [t.get_text() for t in fig.axes[0].get_legend().get_texts()]), close(fig)))
    plot.plot_runs([str(p) for p in runs], str(tmp_path / "plots"))
    assert legends == [["a/run", "b/run", "other"]]
    assert plot.run_labels(["x/y/run", "z/y/run", "run2"]) == ["x/y/run", "z/y/run", "run2"]
    with pytest.raises(SystemExit, match="given twice"):
        plot.run_labels([str(runs[0]), str(runs[0]) + "/"])


def test_docs_hold_the_data_columns_and_the_default_runs_figures(tmp_path, char_tokenizer):
    from transformers import AutoTokenizer

    readme = open(os.path.join(REPO, "README.md")).read()
    assert "shared/" not in readme and "docs/data.md" in readme
    doc = open(os.path.join(REPO, "docs", "data.md")).read()
    for column in ("prompt", "solution", "reward_model", "ground_truth", "problem", "answer",
                   "difficulty"):
        assert f"`{column}`" in doc, column
    ds = data.load_prompts(data.DataConfig(path=_jsonl(tmp_path / "d.jsonl", _good_rows()),
                                           template="plain"),
                           AutoTokenizer.from_pretrained(char_tokenizer))
    for key in ds.stats:  # every count the loader reports is explained
        assert f"`{key}`" in doc, key
    default = " ".join(open(os.path.join(REPO, "configs", "default.py")).read().split('"""')[1]
                       .split())
    cfg = debug_config()
    assert f"({cfg.arithmetic.warmup_target_accuracy}," in default  # the warm-up it stops at
    assert "about 0.15 over the first 10" in default and "about 0.9 over the last 50" in default
    assert "80-100 s" in default and "0.05" not in default and "10 minutes" not in default


# ----------------------------------------------------------------- kill anywhere


@pytest.mark.slow
def test_kill_anywhere_and_resume_equals_uninterrupted(tmp_path):
    cache = str(tmp_path / "jax_cache")
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    kill_resume.run_to_end(ref, 5, cache)
    log = kill_resume.killed_run(killed, 5, cache, trials=10, max_delay_s=6.0, rng=random.Random(0))
    assert sum("killed" in line for line in log) >= 8, log
    assert any("during a save" in line for line in log), log
    assert kill_resume.compare(ref, killed) == []


def test_dead_tensorboard_writer_stops_the_run_instead_of_hanging(tmp_path):
    """A full disk ends tensorboardX's writer thread; the next step's metrics must stop the
    run with an OSError (the one-line resume-hint path), not block forever on TensorBoard's
    bounded queue (a record of more scalars than the queue holds). Its metrics line is
    written first."""
    import threading

    from ba_jax import metrics as metrics_lib

    w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=3, progress=False)
    assert w._tb is not None, "tensorboardX is a dependency: its writer must start"
    w.write(1, {"loss": 1.0})
    w._tb.file_writer.event_writer._worker.stop()  # ended, as a failed write ends it
    out = {}

    def write():
        try:
            w.write(2, {f"m{i}": float(i) for i in range(50)})
        except OSError as e:
            out["error"] = e

    t = threading.Thread(target=write, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the metrics write blocked on a dead TensorBoard writer"
    assert "TensorBoard" in str(out.get("error"))
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    w.close(finished=False)
