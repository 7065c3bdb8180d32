"""Evaluation on the paper's benchmarks: k samples per problem -> avg@k, pass@k, maj@k.

Lives here: `EvalSettings`, `sample_responses` (the rollout engine's queue, in the compute
dtype: the one place evaluation samples), `evaluate_benchmark` (scoring: final answers, their
equivalences, the majority vote), `detect_checkpoint` / `load_model` (which checkpoint layout
a folder holds, and reading it), `run_evaluation` (sample, score and report each benchmark)
and the command

    python -m ba_jax.evaluate --config=configs/default.py --checkpoint=DIR \
        --benchmarks=math500,aime24,aime25,olympiad,minerva,livecodebench --k=4

Not here: the metrics and the results.json / results.md writers (`eval_metrics.py`;
`pass_at_k` is public as `ba_jax.evaluate.pass_at_k`, so it is re-exported here), the prompt
text and its rendering (`eval_prompts.py`), reading the benchmark files (`eval_sets.py`),
answer checking and the code sandbox (`rewards/`), the sampler itself. docs/evaluation.md
documents files and metrics.

Heavy modules (jax, transformers) are imported inside functions: the math scorer's workers
are spawned and re-import this module as their `__main__`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ba_jax.eval_metrics import benchmark_metrics, majority_index, mean_row, results_table
from ba_jax.eval_metrics import write_results
from ba_jax.eval_prompts import eos_ids_of, prompt_text, render_prompts
from ba_jax.eval_sets import BENCHMARKS, Benchmark

# Re-exported (`x as x`): `ba_jax.evaluate.pass_at_k` is the documented public name (README,
# docs/evaluation.md); the prompt constants stay reachable here for existing callers.
from ba_jax.eval_metrics import pass_at_k as pass_at_k
from ba_jax.eval_prompts import CODE_INSTRUCTION as CODE_INSTRUCTION, MATH_SUFFIX as MATH_SUFFIX

_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


# ------------------------------------------------------------------------------ settings


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How responses are sampled and judged; all of it is written to results.json."""

    k: int = 4  # samples per problem
    max_new_tokens: int = 1024
    temperature: float = 0.6  # 0: greedy (then k > 1 repeats one answer)
    top_p: float = 0.95
    seed: int = 0
    batch_prompts: int = 32  # problems per `generate` call (memory bound, one compile per bucket)
    template: str = "chat"  # "chat": the tokenizer's chat template; "plain": data.PLAIN_TEMPLATE
    enable_thinking: bool | None = None  # passed to chat templates that read it (Qwen3)
    math_timeout_s: float = 5.0  # wall clock per math-verify call
    code_timeout_s: float = 6.0  # per test, as LiveCodeBench
    code_memory_mb: int = 1024
    num_workers: int = 0  # scorer processes / sandbox threads; 0: one per CPU (math: <= 8)

    def __post_init__(self):
        if self.k < 1 or self.max_new_tokens < 1 or self.batch_prompts < 1:
            raise ValueError(f"k, max_new_tokens and batch_prompts must be >= 1: {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1: {self}")
        if self.template not in ("chat", "plain"):
            raise ValueError(f"template must be 'chat' or 'plain', got {self.template!r}")


# ------------------------------------------------------------------------------ sampling


@dataclasses.dataclass
class Samples:
    """k decoded responses for each of P prompts."""

    texts: list[list[str]]  # [P][k]
    num_tokens_PG: np.ndarray  # int32 [P, k]: generated tokens, EOS included
    finished_PG: np.ndarray  # bool [P, k]: stopped at an EOS (else cut at max_new_tokens)


def sample_responses(model: Any, tokenizer, prompt_ids: Sequence[Sequence[int]], *,
                     settings: EvalSettings, key, eos_ids: Sequence[int],
                     pad_id: int | None = None, mesh=None) -> Samples:
    """`settings.k` responses per prompt through a `rollout.RolloutEngine` (the in-house
    paged engine: `settings.batch_prompts` prompts of one bucket per call), decoding with
    the model's compute-dtype copy (on `mesh` if given). Sample g of prompt i is drawn with
    key fold_in(fold_in(key, i*k + g), t): the same whatever the batch size, devices or the
    other prompts."""
    from flax import nnx

    from ba_jax.engine import paged
    from ba_jax.rollout import EngineSettings, SamplingSettings

    P, G = len(prompt_ids), settings.k
    graphdef, state = nnx.split(model)
    engine = paged.PagedEngine(graphdef, EngineSettings(
        prompts_per_call=min(settings.batch_prompts, P)), dtype=model.dtype, mesh=mesh)
    engine.sync(state)
    sampling = SamplingSettings(num_samples=G, max_new_tokens=settings.max_new_tokens,
                                eos_ids=tuple(eos_ids), temperature=settings.temperature,
                                top_p=settings.top_p, pad_id=pad_id)
    ro = engine.generate(prompt_ids, sampling, key)
    engine.close()
    eos = set(int(e) for e in eos_ids)
    texts: list[list[str]] = []
    num_tokens_PG = np.zeros((P, G), np.int32)
    finished_PG = np.zeros((P, G), bool)
    for i in range(P):
        rows = slice(i * G, (i + 1) * G)
        ids = [[int(t) for t in row[:n] if int(t) not in eos]
               for row, n in zip(ro.tokens[rows], ro.lengths[rows])]
        texts.append(tokenizer.batch_decode(ids, skip_special_tokens=True))
        num_tokens_PG[i], finished_PG[i] = ro.lengths[rows], ro.finish_reason[rows] == "eos"
    return Samples(texts, num_tokens_PG, finished_PG)


# ------------------------------------------------------------------------------ scoring


def final_answer(response: str) -> str | None:
    """The boxed answer `boxed_reward` would judge: after the last `</think>`, if closed."""
    from ba_jax.rewards.math import extract_boxed

    k = response.rfind("</think>")
    if k >= 0:
        response = response[k + len("</think>"):]
    elif "<think>" in response:
        return None  # unfinished reasoning has no final answer
    return extract_boxed(response)


def _equivalences(answers_PG: list[list[str | None]], scorer) -> dict[tuple[str, str], bool]:
    """Math-verify verdicts for every (earlier, later) pair of distinct answers of a problem."""
    from ba_jax.rewards.math import normalize_answer

    pairs: set[tuple[str, str]] = set()
    for answers in answers_PG:
        firsts: dict[str, str] = {}  # normalised key -> first raw answer with it
        for a in answers:
            if a is not None:
                firsts.setdefault(normalize_answer(a), a)
        raws = list(firsts.values())
        pairs.update((raws[i], raws[j]) for i in range(len(raws)) for j in range(i + 1, len(raws)))
    verdicts: dict[tuple[str, str], bool] = {}
    todo = []
    for a, b in pairs:
        na, nb = normalize_answer(a), normalize_answer(b)
        if _NUMBER_RE.fullmatch(na) and _NUMBER_RE.fullmatch(nb):
            verdicts[(a, b)] = float(na) == float(nb)  # plain numbers need no sympy
        else:
            todo.append((a, b))
    if todo:
        res = scorer.score(["\\boxed{" + b + "}" for _, b in todo], [a for a, _ in todo],
                           rule="boxed")
        verdicts.update(((a, b), bool(ok)) for (a, b), ok in zip(todo, res.correct))
    return verdicts


def evaluate_benchmark(bench: Benchmark, samples: Samples, *, settings: EvalSettings,
                       scorer=None) -> tuple[dict, list[dict]]:
    """Score one benchmark's samples -> (its results.json entry, one record per sample)."""
    from ba_jax.rewards.math import normalize_answer

    P, G = len(bench.problems), settings.k
    flat = [t for texts in samples.texts for t in texts]
    detail: list[dict[str, Any]] = [{} for _ in flat]
    if bench.kind == "math":
        truths = [p.answer for p in bench.problems for _ in range(G)]
        res = scorer.score(flat, truths, rule="boxed", timeout_s=settings.math_timeout_s)
        correct_PG = res.correct.reshape(P, G)
        scoring = {"timeouts": res.num_timeouts, "errors": res.num_errors}
        answers_PG = [[final_answer(t) for t in texts] for texts in samples.texts]
        same_table = _equivalences(answers_PG, scorer)
        majority_P = []
        for answers in answers_PG:
            raw_of = {}
            keys = [None if a is None else normalize_answer(a) for a in answers]
            for a, key in zip(answers, keys):
                if key is not None:
                    raw_of.setdefault(key, a)
            majority_P.append(majority_index(
                keys, lambda x, y, raw_of=raw_of: same_table.get((raw_of[x], raw_of[y]), False)))
        for i, a in enumerate(a for answers in answers_PG for a in answers):
            detail[i]["answer"] = a
    else:
        from ba_jax.rewards.code import check_programs

        items = [(t, list(p.tests)) for p, texts in zip(bench.problems, samples.texts)
                 for t in texts]
        results = check_programs(items, timeout_s=settings.code_timeout_s,
                                 memory_mb=settings.code_memory_mb,
                                 num_workers=settings.num_workers or None)
        correct_PG = np.asarray([r.passed for r in results], bool).reshape(P, G)
        scoring = {"statuses": dict(collections.Counter(r.status for r in results))}
        majority_P = None  # sampled programs are almost never identical: no meaningful vote
        for i, r in enumerate(results):
            detail[i]["status"] = r.status
    metrics = benchmark_metrics(correct_PG, majority_P)
    entry = {
        "kind": bench.kind, "file": bench.path, "num_problems": P, "k": G, **metrics,
        "response_tokens_mean": float(samples.num_tokens_PG.mean()),
        "finished_eos_frac": float(samples.finished_PG.mean()),
        "reader_stats": bench.stats, "scoring": scoring,
        "problems": [{"id": p.id, "correct": int(correct_PG[i].sum()),
                      "maj_correct": None if majority_P is None else bool(
                          majority_P[i] is not None and correct_PG[i, majority_P[i]])}
                     for i, p in enumerate(bench.problems)],
    }
    records = [{"id": bench.problems[i // G].id, "sample": i % G, "correct": bool(correct_PG.flat[i]),
                "num_tokens": int(samples.num_tokens_PG.flat[i]),
                "finished": bool(samples.finished_PG.flat[i]), **detail[i], "response": flat[i]}
               for i in range(P * G)]
    return entry, records


# ------------------------------------------------------------------------------ checkpoints


def detect_checkpoint(path: str) -> tuple[str, str]:
    """(kind, folder) of a checkpoint path: `build.detect_checkpoint`."""
    from ba_jax import build

    return build.detect_checkpoint(path)


def load_model(cfg, path: str, *, step: int | None = None, mesh=None) -> tuple[Any, Any, dict]:
    """(model, tokenizer, info) of any checkpoint layout, read with `cfg`'s model and dtypes:
    `build.load_model` (the config is read there, as for the trainer's policy)."""
    from ba_jax import build

    return build.load_model(cfg, path, step=step, mesh=mesh)


# ------------------------------------------------------------------------------ run


def run_evaluation(model: Any, tokenizer, benches: Sequence[Benchmark], settings: EvalSettings,
                   *, out_dir: str, info: dict, mesh=None, save_samples: bool = True) -> dict:
    """Sample, score and report every benchmark (results rewritten after each one)."""
    import jax

    from ba_jax.rewards.math import MathScorer

    eos = eos_ids_of(tokenizer)
    results: dict[str, Any] = {
        "settings": {**dataclasses.asdict(settings), "checkpoint": info["path"],
                     "checkpoint_kind": info["kind"], "step": info["step"],
                     "benchmarks": [b.name for b in benches]},
        "benchmarks": {}, "mean": {}}
    with MathScorer(timeout_s=settings.math_timeout_s,
                    num_workers=settings.num_workers or None) as scorer:
        for bench in benches:
            texts = [prompt_text(p, bench.kind) for p in bench.problems]
            ids = render_prompts(texts, tokenizer, template=settings.template,
                                 enable_thinking=settings.enable_thinking)
            # One stream per benchmark name: its samples do not depend on which others run.
            key = jax.random.fold_in(jax.random.key(settings.seed), list(BENCHMARKS).index(bench.name))
            samples = sample_responses(model, tokenizer, ids, settings=settings, key=key,
                                       eos_ids=eos, pad_id=tokenizer.pad_token_id, mesh=mesh)
            entry, records = evaluate_benchmark(bench, samples, settings=settings, scorer=scorer)
            results["benchmarks"][bench.name] = entry
            results["mean"] = mean_row(results["benchmarks"])
            write_results(out_dir, results)
            if save_samples:
                os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)
                with open(os.path.join(out_dir, "samples", f"{bench.name}.jsonl"), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in records)
            print(f"{bench.name}: {len(bench)} problems, avg@{settings.k} {entry['avg@k']:.3f}, "
                  f"pass@{settings.k} {entry['pass@k']:.3f}", flush=True)
    return results


# ------------------------------------------------------------------------------ command


def _define_flags():
    """The command's flags (defined only when run as a program: ba_jax.main owns --config too)."""
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
    flags.DEFINE_string("checkpoint", None, "trainer WORKDIR (or its checkpoints/), convert_hf "
                        "output, or Hugging Face folder")
    flags.DEFINE_list("benchmarks", list(BENCHMARKS), f"comma list from {', '.join(BENCHMARKS)}")
    flags.DEFINE_integer("k", 4, "samples per problem")
    flags.DEFINE_string("out", None, "output folder (default: WORKDIR/eval/step_N for trainer "
                        "checkpoints, else CHECKPOINT/eval)")
    flags.DEFINE_string("bench_dir", "data/eval", "folder holding <benchmark>.jsonl / .parquet")
    flags.DEFINE_integer("seed", 0, "sampling seed")
    flags.DEFINE_float("temperature", 0.6, "sampling temperature (0: greedy)")
    flags.DEFINE_float("top_p", 0.95, "nucleus sampling mass")
    flags.DEFINE_integer("max_new_tokens", 0, "response budget; 0: config.rollout.max_new_tokens")
    flags.DEFINE_integer("limit", 0, "first N problems per benchmark (0: all)")
    flags.DEFINE_integer("batch_prompts", 32, "problems per generate call")
    flags.DEFINE_integer("step", -1, "trainer checkpoint step (-1: newest)")
    flags.DEFINE_integer("num_workers", 0, "scorer processes / sandbox threads (0: per CPU)")
    flags.DEFINE_float("code_timeout_s", 6.0, "seconds per LiveCodeBench test")
    flags.DEFINE_bool("save_samples", True, "write OUT/samples/<benchmark>.jsonl")
    from ba_jax import cli

    flags.DEFINE_bool("verbose", False, cli.VERBOSE_HELP)
    flags.mark_flags_as_required(["config", "checkpoint"])


def main(argv) -> None:
    del argv
    from absl import flags, logging

    from ba_jax import build, checkpoint, cli, eval_sets, run_config

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it reads at INFO
    F = flags.FLAGS
    cfg = F.config
    try:
        unknown = [b for b in F.benchmarks if b not in BENCHMARKS]
        if unknown:
            raise ValueError(f"--benchmarks: unknown {unknown}; valid: {', '.join(BENCHMARKS)}")
        settings = EvalSettings(
            k=F.k, max_new_tokens=F.max_new_tokens or cfg.rollout.max_new_tokens,
            temperature=F.temperature, top_p=F.top_p, seed=F.seed,
            batch_prompts=F.batch_prompts, template=cfg.data.template,
            enable_thinking=cfg.data.enable_thinking, code_timeout_s=F.code_timeout_s,
            num_workers=F.num_workers)
        benches = [eval_sets.load_benchmark(
            b, eval_sets.find_benchmark_file(F.bench_dir, b), limit=F.limit)
            for b in F.benchmarks]  # read every file before the (slow) model load
        mesh = build.make_mesh(cfg)
        model, tokenizer, info = load_model(cfg, F.checkpoint, mesh=mesh,
                                            step=None if F.step < 0 else F.step)
        out = F.out or (os.path.join(info["workdir"], "eval", f"step_{info['step']}")
                        if info["kind"] == "trainer" else os.path.join(info["path"], "eval"))
        results = run_evaluation(model, tokenizer, benches, settings, out_dir=out, info=info,
                                 mesh=mesh, save_samples=F.save_samples)
    except checkpoint.NoSuchStep as e:
        e.args = (f"--step={F.step}: {e} (--step=-1 takes the newest)",)
        cli.fail("ba_jax.evaluate", e, verbose=F.verbose)
    except (ValueError, FileNotFoundError, run_config.ConfigError, checkpoint.CheckpointError) as e:
        # the log goes beside the results: --out, or a trainer WORKDIR's own folder
        log_dir = F.out or (F.checkpoint if os.path.isdir(os.path.join(F.checkpoint, "checkpoints"))
                            else None)
        cli.fail("ba_jax.evaluate", e, verbose=F.verbose, log_dir=log_dir)
    print(results_table(results), end="")
    print(f"wrote {os.path.join(out, 'results.json')} and results.md")


if __name__ == "__main__":
    from absl import app

    from ba_jax import cli

    _define_flags()
    app.run(main, flags_parser=cli.absl_flags_parser("ba_jax.evaluate"))
