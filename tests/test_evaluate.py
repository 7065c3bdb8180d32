"""Tests for ba_jax.evaluate and ba_jax.eval_sets: metrics, readers, scoring, the command.

pass@k is checked against exact combinatorics; avg/pass/maj against hand-made correctness
tables; each reader on its fixture (tests/fixtures/bench, made by make_bench_fixtures.py);
scoring with known responses in place of the sampler; the command end to end on a trainer
checkpoint of the `debug` config, and the other checkpoint layouts through `load_model`.
"""

import base64
import itertools
import json
import math
import os
import pickle
import subprocess
import sys
import zlib
from fractions import Fraction

import jax
import numpy as np
import pytest
from helpers_hf import make_tiny_hf, qwen_tokenizer_dir

from ba_jax import eval_sets as es
from ba_jax import evaluate as ev
from ba_jax.tasks import arithmetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "tests", "fixtures", "bench")


def load(name: str, **kw) -> es.Benchmark:
    return es.load_benchmark(name, es.find_benchmark_file(BENCH, name), **kw)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = arithmetic.save_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ----------------------------------------------------------------------------- pass@k


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Exact fraction of k-subsets of n samples (c right) holding at least one right one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_for_all_small_cases():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = brute_pass_at_k(n, c, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # Binomials this size overflow float64 (C(10000, 100) ~ 1e241, C(100000, 1000) is inf).
    for n, c, k in [(10_000, 5, 100), (10_000, 9_000, 500), (100_000, 3, 1000), (2_000, 1, 1)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert ev.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-10)
    assert ev.pass_at_k(2_000, 1, 1) == pytest.approx(1 / 2_000, rel=1e-12)
    values = [ev.pass_at_k(1_000, 7, k) for k in range(1, 1_000)]
    assert all(np.isfinite(values)) and all(np.diff(values) >= 0)


def test_pass_at_k_edges_and_errors():
    assert ev.pass_at_k(5, 0, 3) == 0.0
    assert ev.pass_at_k(5, 5, 1) == 1.0
    assert ev.pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset has a right sample
    assert ev.pass_at_k(4, 1, 4) == 1.0
    for args in [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1), (3.0, 1, 1), (3, True, 1)]:
        with pytest.raises(ValueError):
            ev.pass_at_k(*args)


# ----------------------------------------------------------------------------- avg / maj


def test_benchmark_metrics_from_a_hand_table():
    correct_PG = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], bool)
    majority_P = [0, None, 3, 0]  # picks: right, no answer, right, wrong
    m = ev.benchmark_metrics(correct_PG, majority_P)
    assert m["avg@k"] == pytest.approx((0.25 + 0 + 1 + 0.5) / 4)
    assert m["pass@k"] == pytest.approx(3 / 4)
    assert m["maj@k"] == pytest.approx(2 / 4)
    assert ev.benchmark_metrics(correct_PG, None)["maj@k"] is None


def test_majority_index_counts_ties_and_merges():
    assert ev.majority_index(["3", "4", "4", None]) == 1
    assert ev.majority_index(["a", "b", "b", "a"]) == 0  # tie: the cluster seen first
    assert ev.majority_index(["b", "a", "a", "b"]) == 0
    assert ev.majority_index([None, None]) is None
    assert ev.majority_index([None, "x"]) == 1
    half = lambda a, b: {a, b} == {"1/2", "0.5"}  # noqa: E731
    assert ev.majority_index(["7", "1/2", "0.5"]) == 0  # three singletons without merging
    assert ev.majority_index(["7", "1/2", "0.5"], half) == 1
    assert ev.majority_index(["7", "7", "1/2", "0.5", "1/2"], half) == 2


# ----------------------------------------------------------------------------- readers


def test_math_readers_on_fixtures():
    m = load("math500")
    assert [p.answer for p in m.problems] == ["2", "\\frac{3}{4}", "1024"]
    assert m.problems[0].id == "test/prealgebra/1.json" and m.kind == "math"
    a24, a25 = load("aime24"), load("aime25")
    assert [(p.id, p.answer) for p in a24.problems] == [("60", "33"), ("61", "2")]
    assert [p.answer for p in a25.problems] == ["6", "120"]  # parquet integers, `question` column
    assert a25.problems[1].question == "Compute $5!$."
    o = load("olympiad")
    assert [p.answer for p in o.problems] == ["4", "1, 2"]  # list answers: "$...$" items joined
    assert o.stats == dict(rows_read=3, kept=2, no_question=0, no_answer=1, malformed=0,
                           no_stdin_tests=0)
    mv = load("minerva")
    assert [p.answer for p in mv.problems] == ["\\frac{1}{2}", "60"]  # boxed in `solution`
    assert load("math500", limit=2).stats["kept"] == 2


def test_math_reader_column_variants(tmp_path):
    upper = write_jsonl(tmp_path / "aime24.jsonl", [{"ID": "x", "Problem": "P?", "Answer": 7}])
    b = es.load_benchmark("aime24", upper)
    assert (b.problems[0].id, b.problems[0].question, b.problems[0].answer) == ("x", "P?", "7")
    both = write_jsonl(tmp_path / "m.jsonl", [
        {"question": "Q1", "answer": "5", "solution": "\\boxed{6}"},  # answer wins over solution
        {"question": "Q2", "answer": "", "solution": "so \\boxed{\\frac{1}{3}}."},
        {"question": "", "answer": "1", "solution": ""},
        {"question": "Q4", "answer": None, "solution": "no box"},
    ])
    b = es.load_benchmark("minerva", both)
    assert [p.answer for p in b.problems] == ["5", "\\frac{1}{3}"]
    assert b.stats["no_question"] == 1 and b.stats["no_answer"] == 1 and b.stats["rows_read"] == 4
    missing = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "answer": "1"}])
    with pytest.raises(ValueError, match="'problem' or 'question'"):
        es.load_benchmark("math500", missing)


def test_livecodebench_reader_parses_and_skips_functional():
    b = load("livecodebench")
    assert b.kind == "code" and [p.id for p in b.problems] == ["abc001_a", "cf1_a"]
    assert b.problems[0].tests == ({"input": "1 2\n", "output": "3\n"},
                                   {"input": "10 20\n", "output": "30\n"})
    # Public JSON plus the private base64(zlib(pickle(json))) tests.
    assert [t["output"] for t in b.problems[1].tests] == ["8\n", "0\n", "-14\n"]
    assert b.stats["functional_tests_skipped"] == 3 and b.stats["no_stdin_tests"] == 1
    assert b.stats["rows_read"] == 3 and b.stats["kept"] == 2


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_livecodebench_private_tests_never_unpickle_objects(tmp_path):
    marker = str(tmp_path / "pwned")
    evil = base64.b64encode(zlib.compress(pickle.dumps(_Evil(marker)))).decode()
    good = json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])
    path = write_jsonl(tmp_path / "lcb.jsonl", [
        {"question_content": "Q1", "public_test_cases": good, "private_test_cases": evil},
        {"question_content": "Q2", "public_test_cases": "not json", "private_test_cases": ""},
        {"question_content": "Q3", "public_test_cases": good, "private_test_cases": ""},
    ])
    b = es.load_benchmark("livecodebench", path)
    assert not os.path.exists(marker)
    assert b.stats["malformed"] == 2 and [p.question for p in b.problems] == ["Q3"]
    with pytest.raises(ValueError):
        es.parse_test_cases(evil)


def test_benchmark_file_lookup(tmp_path):
    with pytest.raises(FileNotFoundError, match="math500.jsonl"):
        es.find_benchmark_file(str(tmp_path), "math500")
    with pytest.raises(ValueError, match="unknown benchmark"):
        es.find_benchmark_file(str(tmp_path), "gsm8k")
    for ext in (".jsonl", ".parquet"):
        (tmp_path / f"aime24{ext}").write_text("x")
    with pytest.raises(ValueError, match="several files"):
        es.find_benchmark_file(str(tmp_path), "aime24")


# ----------------------------------------------------------------------------- prompts


def test_prompts_and_templates(char_tokenizer):
    p = es.Problem("0", "What is 1+1?", "2")
    assert ev.prompt_text(p, "math") == "What is 1+1? " + ev.MATH_SUFFIX
    assert ev.CODE_INSTRUCTION in ev.prompt_text(p, "code")
    ids = ev.render_prompts(["ab"], char_tokenizer, template="plain")
    assert char_tokenizer.decode(ids[0]) == "ab\n"
    with pytest.raises(ValueError, match="no chat template"):
        ev.render_prompts(["ab"], char_tokenizer, template="chat")
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(), local_files_only=True)
    text = qwen.decode(ev.render_prompts(["hi"], qwen, template="chat")[0])
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("assistant\n")
    assert qwen.convert_tokens_to_ids("<|im_end|>") in ev.eos_ids_of(qwen)


# ----------------------------------------------------------------------------- scoring


def test_known_responses_are_scored_right(tmp_path, monkeypatch, char_tokenizer):
    """The sampler is replaced by fixed responses; every count below is worked out by hand."""
    responses = {
        "math500": [
            ["so \\boxed{2}", "\\boxed{3}", "<think>unfinished \\boxed{2}"],  # right, wrong, none
            ["\\boxed{5}", "\\boxed{0.75}", "$\\boxed{\\frac{3}{4}}$"],  # 0.75 ~ 3/4 wins the vote
            ["\\boxed{1000}", "\\boxed{1000}", "<think>x</think> \\boxed{1024}"],  # majority wrong
        ],
        "minerva": [["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{2}"], ["\\boxed{60}"] * 3],
        "livecodebench": [
            ["```python\na, b = map(int, input().split())\nprint(a + b)\n```",
             "```python\nprint(3)\n```",  # passes the public test only
             "no program here"],
            ["Here:\n```python\nprint(2 * int(input()))\n```"] * 3,
        ],
    }
    calls = []

    def fake_sample(model, tokenizer, prompt_ids, *, settings, key, eos_ids, pad_id=None, mesh=None):
        texts = [tokenizer.decode(ids) for ids in prompt_ids]
        name = "livecodebench" if ev.CODE_INSTRUCTION in texts[0] else (
            "minerva" if "half" in texts[0] else "math500")
        calls.append((name, texts, np.asarray(jax.random.key_data(key)).tolist()))
        out = responses[name]
        P, G = len(out), settings.k
        return ev.Samples(out, np.full((P, G), 5, np.int32), np.ones((P, G), bool))

    monkeypatch.setattr(ev, "sample_responses", fake_sample)
    benches = [load("math500"), load("minerva"), load("livecodebench")]
    settings = ev.EvalSettings(k=3, max_new_tokens=5, template="plain", code_timeout_s=5.0)
    info = {"path": "ckpt", "kind": "hf", "step": None}
    out = str(tmp_path / "out")
    res = ev.run_evaluation(None, char_tokenizer, benches, settings, out_dir=out, info=info)

    assert [c[0] for c in calls] == ["math500", "minerva", "livecodebench"]
    assert all(t.endswith(ev.MATH_SUFFIX + "\n") for t in calls[0][1])
    assert len({str(c[2]) for c in calls}) == 3  # one PRNG stream per benchmark
    m = res["benchmarks"]["math500"]
    assert [p["correct"] for p in m["problems"]] == [1, 2, 1]
    assert [p["maj_correct"] for p in m["problems"]] == [True, True, False]
    assert m["avg@k"] == pytest.approx(4 / 9) and m["pass@k"] == 1.0
    assert m["maj@k"] == pytest.approx(2 / 3)
    mv = res["benchmarks"]["minerva"]
    assert [p["correct"] for p in mv["problems"]] == [2, 3] and mv["maj@k"] == 1.0
    c = res["benchmarks"]["livecodebench"]
    assert [p["correct"] for p in c["problems"]] == [1, 3]
    assert c["avg@k"] == pytest.approx((1 / 3 + 1) / 2) and c["maj@k"] is None
    assert c["scoring"]["statuses"]["passed"] == 4
    assert res["mean"]["avg@k"] == pytest.approx((4 / 9 + 5 / 6 + 2 / 3) / 3)
    assert res["mean"]["maj@k"] == pytest.approx((2 / 3 + 1) / 2)

    on_disk = json.load(open(os.path.join(out, "results.json")))
    assert on_disk == json.loads(json.dumps(res))
    md = open(os.path.join(out, "results.md")).read()
    assert "| math500 | 3 | 44.4 | 100.0 | 66.7 |" in md
    assert "| livecodebench | 2 | 66.7 | 100.0 | n/a |" in md
    rows = [json.loads(line) for line in open(os.path.join(out, "samples", "math500.jsonl"))]
    assert [r["answer"] for r in rows[:3]] == ["2", "3", None]
    assert [r["correct"] for r in rows[3:6]] == [False, True, True]


# ----------------------------------------------------------------------------- checkpoints


def test_detect_checkpoint_layouts(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_text("")
    assert ev.detect_checkpoint(str(hf)) == ("hf", str(hf))
    conv = tmp_path / "conv"
    (conv / "params").mkdir(parents=True)
    (conv / "model_config.json").write_text("{}")
    assert ev.detect_checkpoint(str(conv))[0] == "converted"
    work = tmp_path / "work"
    (work / "checkpoints" / "10").mkdir(parents=True)
    assert ev.detect_checkpoint(str(work)) == ("trainer", str(work / "checkpoints"))
    assert ev.detect_checkpoint(str(work / "checkpoints"))[0] == "trainer"
    with pytest.raises(ValueError, match="holds no checkpoint"):
        ev.detect_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        ev.detect_checkpoint(str(tmp_path / "missing"))


def test_hf_and_converted_folders_load_and_sample(tmp_path, char_tokenizer):
    from flax import nnx

    from ba_jax import build
    from ba_jax.models import convert_hf

    hf = make_tiny_hf(tmp_path / "hf", vocab_size=128, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=1)
    char_tokenizer.save_pretrained(hf)
    cfg = _debug_config()
    mesh = build.make_mesh(cfg)
    model, tok, info = ev.load_model(cfg, hf, mesh=mesh)
    assert info["kind"] == "hf" and tok.eos_token_id == char_tokenizer.eos_token_id
    conv = str(tmp_path / "conv")
    convert_hf.save_checkpoint(model, conv)
    char_tokenizer.save_pretrained(conv)
    model2, _, info2 = ev.load_model(cfg, conv, mesh=mesh)
    assert info2["kind"] == "converted"
    for x, y in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(model2))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    settings = ev.EvalSettings(k=2, max_new_tokens=4, template="plain", batch_prompts=2)
    ids = ev.render_prompts(["1+1", "2+2", "what is 3+3?"], tok, template="plain")
    sample = lambda seed: ev.sample_responses(  # noqa: E731
        model, tok, ids, settings=settings, key=jax.random.key(seed),
        eos_ids=ev.eos_ids_of(tok), pad_id=tok.pad_token_id, mesh=mesh)
    a, b, c = sample(0), sample(0), sample(1)
    assert len(a.texts) == 3 and all(len(t) == 2 for t in a.texts)
    assert a.texts == b.texts and a.texts != c.texts
    assert a.num_tokens_PG.shape == (3, 2) and (a.num_tokens_PG <= 4).all()


# ----------------------------------------------------------------------------- command


def _debug_config(**overrides):
    from ba_jax import run_config

    return run_config.load_config(os.path.join(REPO, "configs", "default.py:debug"), **overrides)


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    """A trainer workdir of the debug config: warm-up and one RL step, checkpoint at step 1."""
    from ba_jax import train

    workdir = str(tmp_path_factory.mktemp("run"))
    train.train_and_evaluate(_debug_config(num_train_steps=1), workdir)
    return workdir


@pytest.mark.slow
def test_command_end_to_end_on_a_trainer_checkpoint(trained_workdir, tmp_path):
    out = str(tmp_path / "eval")
    cmd = [sys.executable, "-m", "ba_jax.evaluate", "--config=configs/default.py:debug",
           f"--checkpoint={trained_workdir}", f"--bench_dir={BENCH}",
           "--benchmarks=" + ",".join(es.BENCHMARKS), "--k=2", "--limit=2", "--batch_prompts=2",
           "--max_new_tokens=6", "--seed=3", "--temperature=1.0", "--top_p=0.9", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.load(open(os.path.join(out, "results.json")))
    s = res["settings"]
    assert (s["seed"], s["temperature"], s["top_p"], s["k"], s["max_new_tokens"], s["step"]) == (
        3, 1.0, 0.9, 2, 6, 1)
    assert s["checkpoint_kind"] == "trainer" and s["checkpoint"].endswith("checkpoints")
    assert list(res["benchmarks"]) == list(es.BENCHMARKS)
    for name, e in res["benchmarks"].items():
        assert e["num_problems"] == len(e["problems"]) == 2, name
        assert all(0 <= p["correct"] <= 2 for p in e["problems"])
        for metric in ("avg@k", "pass@k"):
            assert 0.0 <= e[metric] <= 1.0
        assert (e["maj@k"] is None) == (name == "livecodebench")
        assert 0 < e["response_tokens_mean"] <= 6
        samples = open(os.path.join(out, "samples", f"{name}.jsonl")).read().splitlines()
        assert len(samples) == 4
    assert res["benchmarks"]["livecodebench"]["reader_stats"]["functional_tests_skipped"] == 0
    assert res["mean"]["num_problems"] == 12 and res["mean"]["num_benchmarks"] == 6
    md = open(os.path.join(out, "results.md")).read()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0] == "| benchmark | problems | avg@2 | pass@2 | maj@2 |"
    assert [line.split("|")[1].strip() for line in table[2:]] == list(es.BENCHMARKS) + ["mean"]
    assert table[0] in proc.stdout  # the table is printed too


def test_command_rejects_a_wrong_config(trained_workdir, tmp_path):
    cfg = _debug_config(**{"model.hidden_size": 64})
    with pytest.raises(Exception, match="config the run was trained with"):
        ev.load_model(cfg, trained_workdir)


def test_an_absent_step_lists_the_steps_there(trained_workdir, tmp_path):
    from ba_jax import checkpoint

    with pytest.raises(checkpoint.NoSuchStep, match=r"^no checkpoint step 7 in .*checkpoints; "
                       r"steps there: 0, 1$"):
        ev.load_model(_debug_config(), trained_workdir, step=7)
    # as a user runs it: one line, naming the flag and the steps (before: the model-shape advice)
    proc = subprocess.run(
        [sys.executable, "-m", "ba_jax.evaluate", "--config=configs/default.py:debug",
         f"--checkpoint={trained_workdir}", f"--bench_dir={BENCH}", "--benchmarks=math500",
         "--k=1", "--limit=1", "--step=7", f"--out={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines == [
        f"ba_jax.evaluate: --step=7: no checkpoint step 7 in {trained_workdir}/checkpoints; "
        "steps there: 0, 1 (--step=-1 takes the newest)"], proc.stderr[-3000:]


def test_a_checkpoint_of_another_shape_names_the_array(trained_workdir):
    from ba_jax import checkpoint

    with pytest.raises(checkpoint.CheckpointError, match=r"its params.embed_tokens.embedding has "
                       r"shape \(101, 32\), this run's model \(101, 48\): a trainer checkpoint "
                       r"is read with --config's model; pass the config the run was trained with"):
        ev.load_model(_debug_config(**{"model.hidden_size": 48}), trained_workdir)
