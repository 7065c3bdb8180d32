"""experiments/paper_reproduction: analyze.py on synthetic runs, the launcher's commands, smoke run."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXP = os.path.join(REPO, "experiments", "paper_reproduction")
LAUNCH = os.path.join(EXP, "launch.sh")

_spec = importlib.util.spec_from_file_location("paper_analyze", os.path.join(EXP, "analyze.py"))
analyze = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(analyze)


def _write_run(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _rows(num_steps, base, mixed=True):
    return [dict(step=s, reward_mean=base + 0.01 * s, accuracy=base / 2 + 0.01 * s,
                 response_length_mean=100.0 + s, response_length_cv=0.5,
                 diag_length_gap=1.5 if mixed or s % 2 else 0.0,
                 diag_num_mixed_groups=3.0 if mixed or s % 2 else 0.0)
            for s in range(1, num_steps + 1)]


def _write_eval(workdir, step, mean_avg):
    out = os.path.join(workdir, "eval", f"step_{step}")
    os.makedirs(out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(benchmarks={}, mean={"avg@k": mean_avg, "num_problems": 1}), f)


@pytest.fixture()
def runs_root(tmp_path):
    root = tmp_path / "runs"
    setting = root / "qwen3-1.7b_dapo17k"
    for i, agg in enumerate(("balanced", "token", "sequence")):  # written out of order
        _write_run(str(setting / agg), _rows(20, base=0.1 * i, mixed=agg != "token"))
    _write_eval(str(setting / "balanced"), 10, 0.30)
    _write_eval(str(setting / "balanced"), 20, 0.4321)
    _write_run(str(root / "smoke" / "balanced_batch"), _rows(3, base=0.0))
    (root / "not_a_run").mkdir()
    return str(root)


def test_find_runs_orders_aggregators_like_the_paper(runs_root):
    runs = analyze.find_runs(runs_root)
    assert list(runs) == ["qwen3-1.7b_dapo17k", "smoke"]
    assert list(runs["qwen3-1.7b_dapo17k"]) == ["sequence", "token", "balanced"]
    assert list(runs["smoke"]) == ["balanced_batch"]


def test_length_gap_is_undefined_without_mixed_groups(runs_root):
    rows = analyze.read_metrics(os.path.join(runs_root, "qwen3-1.7b_dapo17k", "token"))
    steps_S, gap_S = analyze.series(rows, "diag_length_gap")
    assert np.array_equal(steps_S, np.arange(1, 21))
    assert np.all(np.isnan(gap_S[1::2])) and np.all(gap_S[0::2] == 1.5)  # even steps unmixed
    _, acc_S = analyze.series(rows, "accuracy")
    assert np.isfinite(acc_S).all()
    assert analyze.last_mean(rows, "accuracy", 4) == pytest.approx(0.05 + 0.01 * 18.5)


def test_eval_score_takes_the_newest_step(runs_root):
    wd = os.path.join(runs_root, "qwen3-1.7b_dapo17k")
    assert analyze.eval_score(os.path.join(wd, "balanced")) == (20, pytest.approx(0.4321))
    assert analyze.eval_score(os.path.join(wd, "token")) is None


def test_analyze_writes_figures_and_summary(runs_root, tmp_path):
    out = str(tmp_path / "fig")
    analyze.main([runs_root, "--out", out, "--last", "5"])
    for name in ("qwen3-1.7b_dapo17k.png", "smoke.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(os.path.join(out, "summary.md")).read()
    lines = md.splitlines()
    seq = next(line for line in lines if line.startswith("| qwen3-1.7b_dapo17k | sequence |"))
    cells = [c.strip() for c in seq.split("|")[1:-1]]
    # sequence is the run with base 0.2: reward over steps 16..20 = 0.2 + 0.01 * 18
    assert cells[2] == "20" and float(cells[3]) == pytest.approx(0.38)
    table = next(line for line in lines if line.startswith("| qwen3-1.7b_dapo17k | -"))
    assert "0.4321 @20 (0.4695)" in table and "- (0.4481)" in table and "- (0.4360)" in table


def test_analyze_without_runs_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no RUNS_ROOT"):
        analyze.analyze(str(tmp_path))


def _launch(env_extra, **kw):
    names = ("QWEN3_1_7B_CKPT", "QWEN3_1_7B_HF", "QWEN25_MATH_7B_CKPT", "QWEN25_MATH_7B_HF",
             "DAPO17K_PATH", "POLARIS_PATH", "MODELS", "DATASETS", "AGGS", "SMOKE", "DRY_RUN")
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(env_extra)
    return subprocess.run(["bash", LAUNCH], cwd=REPO, capture_output=True, text=True,
                          env=env, **kw)


def test_launcher_prints_the_twelve_runs_and_their_evaluation(tmp_path):
    env = dict(DRY_RUN="1", RUNS_ROOT=str(tmp_path / "r"), QWEN3_1_7B_CKPT="/w/q3",
               QWEN3_1_7B_HF="/hf/q3", QWEN25_MATH_7B_CKPT="/w/q7", QWEN25_MATH_7B_HF="/hf/q7",
               DAPO17K_PATH="/d/dapo.parquet", POLARIS_PATH="/d/polaris.parquet", EVAL_K="8")
    proc = _launch(env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmds = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    train = [c for c in cmds if " -m ba_jax.main " in c]
    evals = [c for c in cmds if " -m ba_jax.evaluate " in c]
    assert len(train) == len(evals) == 12 and len(cmds) == 25
    assert cmds[-1].endswith(f"analyze.py {tmp_path / 'r'}")
    grid = {(m, d, a) for m in ("qwen3-1.7b", "qwen2.5-math-7b") for d in ("dapo17k", "polaris")
            for a in ("sequence", "token", "balanced")}
    seen = set()
    for t, e in zip(train, evals):
        cfg = t.split("--config=configs/paper.py:")[1].split()[0]
        parts = dict(kv.split("=") for kv in cfg.split(","))
        m, d, a = parts["model"], parts["data"], parts["agg"]
        seen.add((m, d, a))
        wd = f"{tmp_path / 'r'}/{m}_{d}/{a}"
        assert f"--workdir={wd}" in t and f"--checkpoint={wd}" in e
        ckpt, hf = ("/w/q3", "/hf/q3") if m == "qwen3-1.7b" else ("/w/q7", "/hf/q7")
        data = "/d/dapo.parquet" if d == "dapo17k" else "/d/polaris.parquet"
        for c in (t, e):
            assert f"--config.model.init_path={ckpt}" in c and f"--config.tokenizer_path={hf}" in c
            assert f"--config.data.path={data}" in c and f"configs/paper.py:{cfg}" in c
        assert "--k=8" in e
        assert "--benchmarks=math500,aime24,aime25,olympiad,minerva,livecodebench" in e
    assert seen == grid


def test_launcher_names_a_missing_path(tmp_path):
    proc = _launch(dict(DRY_RUN="1", RUNS_ROOT=str(tmp_path), MODELS="qwen3-1.7b",
                        QWEN3_1_7B_CKPT="/w/q3"), timeout=60)
    assert proc.returncode == 2 and "QWEN3_1_7B_HF" in proc.stderr
    assert " -m ba_jax.main " not in proc.stdout


@pytest.mark.slow
def test_smoke_mode_runs_three_aggregators_end_to_end(tmp_path):
    root = tmp_path / "smoke_runs"
    proc = _launch(dict(SMOKE="1", RUNS_ROOT=str(root), PYTHON=sys.executable), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    has_eval = os.path.exists(os.path.join(REPO, "ba_jax", "evaluate.py"))
    for agg in ("sequence", "token", "balanced"):
        wd = root / "smoke" / agg
        rows = [json.loads(line) for line in open(wd / "metrics.jsonl")]
        assert [r["step"] for r in rows] == [1, 2]
        if has_eval:
            assert analyze.eval_score(str(wd))[0] == 2
    assert (root / "figures" / "smoke.png").exists()
    md = (root / "figures" / "summary.md").read_text()
    assert all(f"| smoke | {agg} | 2 |" in md for agg in ("sequence", "token", "balanced"))
