"""Tests for ba_jax.rewards.math: the DAPO and boxed rules, extraction helpers, the scorer pool."""

import os
import threading
import time

import numpy as np
import pytest

from ba_jax.rewards.math import (
    MathScorer,
    boxed_reward,
    dapo_reward,
    extract_answer_line,
    extract_boxed,
    normalize_answer,
    overlong_penalty,
    score_batch,
)

DAPO_CASES = [
    ("Let me compute.\nAnswer: 42", "42", 1.0),
    ("Answer: 43", "42", -1.0),
    ("Answer: \\boxed{42}", "42", 1.0),
    ("Answer: $42$", "42", 1.0),
    ("Answer: $\\boxed{42}$.", "42", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: -1,000", "-1000", 1.0),
    ("Answer: 1,2", "12", -1.0),  # a list, not a thousands separator
    ("Answer: 12 \\text{ cm}", "12", 1.0),
    ("Answer: 5 students", "5", 1.0),
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer: \\$5", "5", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: \\frac{1}2", "\\frac{1}{2}", 1.0),
    ("Answer: \\dfrac{1}{2}", "\\frac12", 1.0),
    ("Answer: \\frac{\\sqrt3}2", "\\frac{\\sqrt{3}}{2}", 1.0),
    ("Answer: x = 5", "5", 1.0),
    ("Answer: -7", "-7", 1.0),
    ("Answer: 7", "-7", -1.0),
    ("Answer: 42.", "42", 1.0),
    ("ANSWER: 42", "42", 1.0),
    ("answer : 42", "42", 1.0),
    ("Answer: 41\nWait, that is wrong.\nAnswer: 42", "42", 1.0),
    ("Answer: 41\nWait, that is wrong.\nAnswer: 42", "41", -1.0),
    ("The result is 42.", "42", -1.0),  # no Answer line
    ("", "42", -1.0),
    ("Answer: 42\n" + "x" * 400, "42", -1.0),  # outside the 300-character window
    ("x" * 400 + "\nAnswer: 42", "42", 1.0),
]


@pytest.mark.parametrize("response,truth,expected", DAPO_CASES)
def test_dapo_reward(response, truth, expected):
    assert dapo_reward(response, truth) == expected


BOXED_CASES = [
    ("so \\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", 1.0),
    ("so \\boxed{\\frac{1}{\\sqrt{3}}}", "\\frac{\\sqrt{3}}{3}", 1.0),  # nested braces
    ("so \\boxed{(1, 2]}", "(1,2]", 1.0),
    ("so \\boxed{[1, 2]}", "(1,2]", 0.0),
    ("so \\boxed{\\{3, 2, 1\\}}", "\\{1,2,3\\}", 1.0),
    ("so \\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("so \\boxed{4}", "3", 0.0),
    ("so \\boxed{-3}", "3", 0.0),
    ("the answer is 4", "4", 0.0),  # nothing boxed
    ("$\\boxed 5$", "5", 1.0),
    ("\\fbox{5}", "5", 1.0),
    ("first \\boxed{3}, no wait: \\boxed{5}", "5", 1.0),
    ("first \\boxed{3}, no wait: \\boxed{5}", "3", 0.0),
    ("truncated \\boxed{\\frac{1}{2", "\\frac{1}{2}", 0.0),
    ("<think>maybe \\boxed{3}</think>The answer is \\boxed{4}.", "4", 1.0),
    ("<think>maybe \\boxed{3}</think>The answer is \\boxed{4}.", "3", 0.0),
    ("<think>still thinking \\boxed{4}", "4", 0.0),  # never closed: no answer
    ("so \\boxed{4}", "", 0.0),
]


@pytest.mark.parametrize("response,truth,expected", BOXED_CASES)
def test_boxed_reward(response, truth, expected):
    assert boxed_reward(response, truth) == expected


def test_boxed_reward_off_main_thread():
    # math_verify's signal.alarm raises off the main thread unless boxed_reward disables it.
    out = {}

    def run():
        try:
            out["value"] = boxed_reward("\\boxed{\\frac{2}{4}}", "0.5")
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert out == {"value": 1.0}


def test_helpers():
    assert extract_answer_line("x\nAnswer:  7 apples \nmore") == "7 apples"
    assert extract_answer_line("no answer") is None
    assert extract_answer_line("Answer: 1" + "y" * 400, window=None) == "1" + "y" * 400
    assert extract_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_boxed("\\boxed{1") is None
    assert extract_boxed("nothing") is None
    assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_answer("\\text{(A)}") == "(A)"
    assert normalize_answer("\\sqrt[3]{8}") == "\\sqrt[3]{8}"
    assert normalize_answer("1,234,567.5") == "1234567.5"


def test_overlong_penalty():
    lengths_B = np.array([0, 6, 7, 8, 10, 12])
    got_B = overlong_penalty(lengths_B, max_len=10, buffer=4, factor=1.0)
    np.testing.assert_allclose(got_B, [0.0, 0.0, -0.25, -0.5, -1.0, -1.5])
    assert got_B.dtype == np.float32
    np.testing.assert_allclose(
        overlong_penalty(lengths_B, max_len=10, buffer=4, factor=0.5), got_B * 0.5
    )


# --- the pool. Module-level functions so spawned workers can import them by name.


def _misbehaving_rule(response: str, ground_truth: str) -> float:
    """dapo_reward, except for responses that hang, kill their process or raise."""
    if response == "HANG":
        time.sleep(600)
    if response == "DIE":
        os._exit(3)
    if response == "RAISE":
        raise ValueError("bad item")
    return dapo_reward(response, ground_truth)


@pytest.fixture(scope="module")
def scorer():
    with MathScorer(timeout_s=20.0, num_workers=2) as s:
        yield s


def test_pool_boxed_matches_in_process(scorer):
    responses = [r for r, _, _ in BOXED_CASES]
    truths = [t for _, t, _ in BOXED_CASES]
    result = scorer.score(responses, truths, rule="boxed")
    expected_B = np.array([e for _, _, e in BOXED_CASES], np.float32)
    np.testing.assert_array_equal(result.rewards, expected_B)
    np.testing.assert_array_equal(result.correct, expected_B == 1.0)
    assert result.rewards.dtype == np.float32 and result.correct.dtype == bool
    assert (result.num_timeouts, result.num_errors) == (0, 0)


def test_pool_dapo_large_batch(scorer):
    # 40 items is above the in-process threshold, so this goes through the workers.
    cases = DAPO_CASES + DAPO_CASES[:12]
    result = scorer.score([r for r, _, _ in cases], [t for _, t, _ in cases], rule="dapo")
    np.testing.assert_array_equal(result.rewards, [e for _, _, e in cases])
    np.testing.assert_array_equal(result.correct, [e == 1.0 for _, _, e in cases])


def test_pool_timeouts_and_crashes_score_wrong(scorer):
    responses = ["Answer: 1", "HANG", "Answer: 2", "DIE", "RAISE", "Answer: 3"]
    truths = ["1", "1", "2", "1", "1", "4"]
    start = time.monotonic()
    result = scorer.score(
        responses, truths, rule=_misbehaving_rule, timeout_s=1.0, wrong_value=-1.0
    )
    # Returned long before the hung item's 600 s sleep could have finished.
    assert time.monotonic() - start < 300
    np.testing.assert_array_equal(result.rewards, [1.0, -1.0, 1.0, -1.0, -1.0, -1.0])
    np.testing.assert_array_equal(result.correct, [True, False, True, False, False, False])
    assert result.num_timeouts == 1
    assert result.num_errors == 2
    # The pool recovered: the next batch scores normally.
    again = scorer.score(["\\boxed{2}"] * 3, ["2", "3", "2"], rule="boxed")
    np.testing.assert_array_equal(again.rewards, [1.0, 0.0, 1.0])
    assert (again.num_timeouts, again.num_errors) == (0, 0)


def test_score_batch_small_dapo_in_process():
    result = score_batch(["Answer: 5", "Answer: 6", "nothing"], ["5", "5", "5"], rule="dapo")
    np.testing.assert_array_equal(result.rewards, [1.0, -1.0, -1.0])
    np.testing.assert_array_equal(result.correct, [True, False, False])


def test_score_rejects_bad_input(scorer):
    with pytest.raises(ValueError, match="unknown reward rule"):
        scorer.score(["a"], ["b"], rule="exact")
    with pytest.raises(ValueError, match="ground truths"):
        scorer.score(["a", "b"], ["b"], rule="dapo")


def test_pool_replaces_a_worker_that_died_while_idle(scorer):
    scorer.score(["\\boxed{1}"] * 4, ["1"] * 4, rule="boxed")  # make sure the pool is up
    dead = scorer._workers[0].process
    dead.kill()
    dead.join()
    result = scorer.score(["\\boxed{1}"] * 4, ["1"] * 4, rule="boxed")
    np.testing.assert_array_equal(result.rewards, [1.0] * 4)
    assert (result.num_timeouts, result.num_errors) == (0, 0)
    assert all(w.process.is_alive() for w in scorer._workers)
