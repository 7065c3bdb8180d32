"""Tests of the length-study task family: knobs, reward of constructed responses, determinism."""

import json

import numpy as np
import pytest

from ba_jax.rewards.math import dapo_reward
from ba_jax.tasks import arithmetic, length_task
from ba_jax.tasks.length_task import LengthTaskConfig, Problem


def _tokens(text: str) -> int:
    """Tokens of a response under the character tokenizer, with EOS."""
    vocab = arithmetic.vocab()
    n, i = 0, 0
    while i < len(text):
        piece = next((p for p in arithmetic._PIECES if text.startswith(p, i)), text[i])
        assert piece in vocab
        i += len(piece)
        n += 1
    return n + 1


def _reference_set(cfg: LengthTaskConfig, seed: int = 0, n: int = 400):
    rng = np.random.default_rng(seed)
    problems = length_task.all_problems(cfg)
    picked = [problems[i] for i in rng.integers(len(problems), size=n)]
    right = [length_task.right_response(p) for p in picked]
    wrong = [length_task.wrong_response(rng, p, cfg) for p in picked]
    return picked, right, wrong


def test_counter_and_right_response():
    p = Problem(start=7, step=1, num_steps=5)
    assert p.prompt == "7+1:e Answer: N"
    assert length_task.right_response(p) == "a8 b9 c0 d1 e2 Answer: 2"
    assert p.answer == 2
    assert _tokens(length_task.right_response(p)) == length_task.response_length(5) == 20


@pytest.mark.parametrize("setting", sorted(length_task.SETTINGS))
def test_reward_of_reference_responses(setting):
    cfg = length_task.SETTINGS[setting]
    picked, right, wrong = _reference_set(cfg)
    for p, r, w in zip(picked, right, wrong):
        assert dapo_reward(r, str(p.answer)) == 1.0, (p, r)
        assert dapo_reward(w, str(p.answer)) == -1.0, (p, w)
        assert _tokens(r) == length_task.response_length(p.num_steps)
        assert _tokens(w) <= cfg.max_response_tokens


def test_reward_of_malformed_responses():
    p = Problem(3, 1, 2)
    assert dapo_reward("a4 b5 ", "5") == -1.0  # no answer line
    assert dapo_reward("a4 b5 Answer: 5", "5") == 1.0
    assert dapo_reward("Answer: 5", "5") == 1.0  # a lucky guess scores: only the answer counts
    assert p.answer == 5


def _gap(picked, right, wrong) -> float:
    return float(np.mean([_tokens(w) for w in wrong]) / np.mean([_tokens(r) for r in right]))


def _cv(texts) -> float:
    lengths = np.array([_tokens(t) for t in texts], float)
    return float(lengths.std() / lengths.mean())


def test_gap_knob():
    """misreport: wrong as long as right; overshoot: longer; undershoot: shorter."""
    s = length_task.SETTINGS
    assert _gap(*_reference_set(s["small_gap"])) == pytest.approx(1.0)
    # Per problem too: a misreport has exactly the right response's length.
    picked, right, wrong = _reference_set(s["small_gap"])
    assert all(_tokens(r) == _tokens(w) for r, w in zip(right, wrong))
    assert _gap(*_reference_set(s["large_gap"])) > 1.5
    assert _gap(*_reference_set(s["short_wrong"])) < 0.75
    picked, right, wrong = _reference_set(s["large_gap"])
    assert all(_tokens(w) > _tokens(r) for r, w in zip(right, wrong))


def test_variation_knob():
    """The k range alone sets the spread of right-response lengths."""
    s = length_task.SETTINGS
    cv_small = _cv(_reference_set(s["small_gap"])[1])
    cv_large = _cv(_reference_set(s["large_variation"])[1])
    assert cv_large > 2 * cv_small
    assert s["small_gap"].wrong_mode == s["large_variation"].wrong_mode  # only k moved


def test_warmup_mixture_share():
    cfg = length_task.SETTINGS["large_gap"]
    rng = np.random.default_rng(0)
    problems = length_task.all_problems(cfg) * 20
    texts, right_B = length_task.warmup_responses(rng, problems, cfg)
    assert abs(right_B.mean() - cfg.right_frac) < 0.03
    scores = np.array([dapo_reward(t, str(p.answer)) for t, p in zip(texts, problems)])
    np.testing.assert_array_equal(scores == 1.0, right_B)


def test_determinism(tmp_path):
    cfg = length_task.SETTINGS["large_variation"]
    a = length_task.write_problems(str(tmp_path / "a.jsonl"), cfg, seed=3)
    b = length_task.write_problems(str(tmp_path / "b.jsonl"), cfg, seed=3)
    c = length_task.write_problems(str(tmp_path / "c.jsonl"), cfg, seed=4)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    assert a == b and a != c and sorted(a, key=str) == sorted(c, key=str)
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(rows) == len(set(r["prompt"] for r in rows)) == len(length_task.all_problems(cfg))
    w1 = length_task.warmup_responses(np.random.default_rng(5), a[:50], cfg)
    w2 = length_task.warmup_responses(np.random.default_rng(5), a[:50], cfg)
    assert w1[0] == w2[0] and (w1[1] == w2[1]).all()


def test_invalid_settings():
    with pytest.raises(ValueError):
        LengthTaskConfig(k_min=1, k_max=4, wrong_mode="ramble")
    with pytest.raises(ValueError):
        LengthTaskConfig(k_min=20, k_max=24, wrong_mode="overshoot")  # past letter z
    with pytest.raises(ValueError):
        LengthTaskConfig(k_min=2, k_max=4, wrong_mode="overshoot", m_max=10)  # could be right


def test_prompts_through_loader(tmp_path):
    """The trainer's loader reads the file as-is (no DAPO instruction) with the right truths."""
    from transformers import AutoTokenizer

    from ba_jax import data

    cfg = length_task.SETTINGS["small_gap"]
    path = str(tmp_path / "p.jsonl")
    problems = length_task.write_problems(path, cfg, seed=0)
    tok = AutoTokenizer.from_pretrained(arithmetic.save_tokenizer(str(tmp_path / "tok")))
    ds = data.load_prompts(data.DataConfig(path=path, format="dapo17k", template="plain",
                                           max_prompt_tokens=32), tok)
    assert ds.ground_truths == [str(p.answer) for p in problems]
    assert ds.prompts_text[0] == problems[0].prompt + "\n"
    assert ds.reward_rule == "dapo"
