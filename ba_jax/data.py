"""Prompt data: local parquet / JSONL math sets -> deduplicated, templated, tokenized prompts.

Lives here: `DataConfig`, `load_prompts` (DAPO-Math-17k in its original chat shape and its
processed plain shape, Polaris-53K), `PromptDataset`, and `PromptIterator` (deterministic,
resumable shuffling of prompt indices). Not here: answer checking (`rewards/math.py`),
the evaluation sets (`eval_sets.py`), padding prompts to bucket lengths (`sampler.py`).

Nothing is fetched: files are read through Hugging Face `datasets` with
`HF_DATASETS_OFFLINE=1` and its progress bars off (`load_local_dataset`, shared with the
evaluation-set reader). A file `datasets` cannot read is named with its first bad line
(`_json_lines_problem`). Every row that is not kept is counted in `PromptDataset.stats` under
one reason (the `Skip` it raised; the evaluation-set reader counts its rows the same way),
so `rows_read == kept + sum(drop counts)`; kept prompts whose answer was a float are counted
too (`FLOAT_ANSWER_COUNTS`, see `_answer_text`), and the trainer prints it all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import threading
from typing import Any

import numpy as np

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before `datasets` reads its config

FORMATS = ("dapo17k", "polaris", "auto")
TEMPLATES = ("chat", "plain")
REWARD_RULES = ("dapo", "boxed")

# DAPO-Math-17k's own instruction, wrapped around processed-shape prompts that lack it:
# the `dapo` reward looks for an "Answer:" line, so the model must be asked for one.
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
POLARIS_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
# Base models get the bare question and a newline: Qwen2.5-Math base models answer best
# with no template at all (Liu et al. 2025, "Understanding R1-Zero-like training"), and a
# "Question:/Answer:" frame would collide with the DAPO rule's "Answer:" line.
PLAIN_TEMPLATE = "{problem}\n"

# A Polaris answer is not checkable when it is empty or is an argument rather than a value.
_NO_ANSWER_RE = re.compile(r"\b(?:proofs?|prove[sdn]?|q\.?e\.?d)\b|\\blacksquare|\\square", re.I)
_DIFFICULTY_RE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_DAPO_INSTRUCTION_RE = re.compile(r"Answer\s*:", re.I)
_TOKENIZE_CHUNK = 1024
# Stats keys that are not drop reasons: kept prompts whose answer column held a float.
FLOAT_ANSWER_COUNTS = ("float_answers_integral", "float_answers_fractional")
_DATASETS_SWITCHES = threading.Lock()  # datasets' progress-bar and log switches are global

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how they become token ids."""

    path: str  # local .parquet, .jsonl or .json file
    format: str = "auto"  # "dapo17k", "polaris", or "auto": detected from the columns
    template: str = "chat"  # "chat": the tokenizer's chat template; "plain": PLAIN_TEMPLATE
    max_prompt_tokens: int = 1024  # longer prompts (after templating) are skipped, counted
    # Appended to the problem text after a space. None: the format's default (POLARIS_SUFFIX
    # for Polaris, nothing for DAPO, whose prompts carry their instruction); "": none.
    prompt_suffix: str | None = None
    # Passed to chat templates that read it (Qwen3: False adds an empty think block).
    # None: the template's own default.
    enable_thinking: bool | None = None
    reward_rule: str | None = None  # "dapo" or "boxed"; None: dapo17k -> dapo, polaris -> boxed
    cache_dir: str | None = None  # Hugging Face `datasets` cache; None: its default

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"DataConfig.format must be one of {FORMATS}, got {self.format!r}")
        if self.template not in TEMPLATES:
            raise ValueError(
                f"DataConfig.template must be one of {TEMPLATES}, got {self.template!r}"
            )
        if self.reward_rule is not None and self.reward_rule not in REWARD_RULES:
            raise ValueError(
                f"DataConfig.reward_rule must be one of {REWARD_RULES}, got {self.reward_rule!r}"
            )
        if self.max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be positive, got {self.max_prompt_tokens}")


@dataclasses.dataclass
class PromptDataset:
    """Tokenized prompts with their answers, in file order (first copy of each problem)."""

    prompt_ids: list[list[int]]  # token ids of the templated prompt
    prompts_text: list[str]  # the templated prompt the ids encode
    ground_truths: list[str]  # reference answers, as strings
    reward_rule: str  # "dapo" or "boxed"
    # rows_read, kept, and the drop reasons: duplicates_dropped, too_long, no_answer,
    # malformed, empty_prompt, empty_row; then FLOAT_ANSWER_COUNTS (of the kept prompts).
    stats: dict[str, int]
    source: str = ""  # the file or folder it was read from (DataConfig.path)

    def __len__(self) -> int:
        return len(self.prompt_ids)


class Skip(Exception):
    """A row that is dropped, with the stats key it is counted under (`reason`).

    Raised by the row readers here and in `eval_sets.py`, caught by their loops.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _answer_text(value: Any) -> tuple[str, str | None]:
    """A ground truth as a stripped string, and the stats key counting a float conversion.

    Integers are written out. A float (a parquet or pandas answer column of floats holds
    5.0 for the answer 5) is written in positional notation with the fewest digits that
    read back as the same number: 5.0 -> "5" (counted under `float_answers_integral`),
    2.5 -> "2.5", 1e-05 -> "0.00001" (`float_answers_fractional`). A value that is exactly
    a float32 (a float32 column) gets the fewest digits at float32 precision, so 0.1 stored
    as float32 gives "0.1", not "0.10000000149011612". NaN is a missing answer (pandas
    writes missing values as NaN); an infinity is malformed.
    """
    if value is None:
        raise Skip("no_answer")
    if isinstance(value, (bool, np.bool_)):
        raise Skip("malformed")
    if isinstance(value, (float, np.floating)):
        return _float_text(float(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value)), None
    if not isinstance(value, str):
        raise Skip("malformed")
    text = value.strip()
    if not text:
        raise Skip("no_answer")
    return text, None


def _float_text(x: float) -> tuple[str, str]:
    if x != x:
        raise Skip("no_answer")
    if x in (float("inf"), float("-inf")):
        raise Skip("malformed")
    x += 0.0  # -0.0 -> 0.0
    with np.errstate(over="ignore"):
        single = np.float32(x)
    # Compared as float64: numpy would compare a float32 with a Python float at float32.
    value = single if float(single) == x else np.float64(x)
    text = np.format_float_positional(value, unique=True, trim="-")
    return text, FLOAT_ANSWER_COUNTS[0] if x.is_integer() else FLOAT_ANSWER_COUNTS[1]


def _problem_text(value: Any) -> str:
    if not isinstance(value, str):
        raise Skip("malformed")
    if not value.strip():
        raise Skip("empty_prompt")
    return value


def _dapo_row(row: dict[str, Any], suffix: str) -> tuple[list[dict[str, str]], str, str | None]:
    """Messages, ground truth and its float-conversion key of a DAPO-Math-17k row, in
    either published shape."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):  # processed shape: the bare problem
        text = _problem_text(prompt)
        if not _DAPO_INSTRUCTION_RE.search(text):
            text = DAPO_PREFIX + text + DAPO_SUFFIX
        messages = [{"role": "user", "content": text}]
    elif isinstance(prompt, list):  # original shape: a chat list with one user message
        well_formed = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
        if not well_formed or [m["role"] for m in prompt].count("user") != 1:
            raise Skip("malformed")
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        _problem_text(next(m["content"] for m in messages if m["role"] == "user"))
    else:
        raise Skip("malformed")
    if "solution" in row:
        truth, converted = _answer_text(row["solution"])
    else:
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise Skip("malformed")
        truth, converted = _answer_text(reward_model["ground_truth"])
    if suffix:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] += " " + suffix
    return messages, truth, converted


def _polaris_row(row: dict[str, Any], suffix: str) -> tuple[list[dict[str, str]], str, str | None]:
    """Messages, ground truth and its float-conversion key of a Polaris row; proofs and
    empty answers are no_answer."""
    text = _problem_text(row.get("problem"))
    difficulty = row.get("difficulty")
    if difficulty is not None:  # informative only, but a bad value means a broken row
        m = _DIFFICULTY_RE.fullmatch(difficulty) if isinstance(difficulty, str) else None
        if m is None or int(m.group(1)) > int(m.group(2)) or int(m.group(2)) == 0:
            raise Skip("malformed")
    truth, converted = _answer_text(row.get("answer"))
    if not truth.strip("$ ") or _NO_ANSWER_RE.search(truth):
        raise Skip("no_answer")
    if suffix:
        text = text + " " + suffix
    return [{"role": "user", "content": text}], truth, converted


@contextlib.contextmanager
def _quiet_datasets():
    """`datasets` without its "Generating train split" progress bars and info logs: the
    run's own progress bar and reports are what a user reads. Restored afterwards."""
    import datasets

    with _DATASETS_SWITCHES:
        bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        try:
            yield
        finally:
            datasets.logging.set_verbosity(verbosity)
            if bars:
                datasets.enable_progress_bars()


def load_local_dataset(builder: str, path: str, cache_dir: str | None = None):
    """A local file as a `datasets.Dataset` ("parquet" or "json" builder), read quietly."""
    import datasets

    with _quiet_datasets():
        return datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir)


def _read_rows(config: DataConfig):
    """The file as a `datasets.Dataset`, with clear errors for missing or empty files."""
    path = config.path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"data file is empty: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            num_rows = pq.read_metadata(path).num_rows
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"could not read parquet file {path}: {e}") from e
        if num_rows == 0:
            raise ValueError(f"data file is empty (no rows): {path}")
        builder = "parquet"
    elif path.endswith((".jsonl", ".json")):
        with open(path, "rb") as f:
            if not f.read(4096).strip():
                raise ValueError(f"data file is empty: {path}")
        builder = "json"
    else:
        raise ValueError(f"data file must be .parquet, .jsonl or .json: {path}")
    try:
        return load_local_dataset(builder, path, config.cache_dir)
    except Exception as e:  # noqa: BLE001  datasets raises many types; name the file
        where = _json_lines_problem(path) if builder == "json" else None
        raise ValueError(f"could not read data file {path}: {where or e}") from e


def _batches(table, path: str):
    """The table's rows, 4096 at a time. pyarrow keeps a JSON file's bytes that are not
    UTF-8 as they are, and they fail only here: named by their line."""
    try:
        yield from table.iter(batch_size=4096)
    except UnicodeDecodeError as e:
        where = _json_lines_problem(path) if path.endswith((".jsonl", ".json")) else None
        raise ValueError(f"could not read data file {path}: {where or e}") from e


def _json_lines_problem(path: str) -> str | None:
    """Why a JSON Lines file cannot be read, naming the line (`datasets` names a byte
    position at most): the first line that is not UTF-8, not JSON or not an object, or
    rows that are all `{}`. None for a file of another shape (a JSON array)."""
    rows = empty = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 ({e.reason} at byte {e.start})"
            if not text.strip():
                continue
            if rows == 0 and text.lstrip().startswith("["):
                return None
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"line {number} is a JSON {type(row).__name__}, not an object"
            rows, empty = rows + 1, empty + (not row)
    if rows and empty == rows:
        return (f"every one of its {rows} rows is an empty object {{}}: there is nothing to "
                "read (rows with a prompt and an answer are needed)")
    return None


def _resolve_format(config: DataConfig, columns: list[str]) -> str:
    """The row format, or a clear error naming the file and the missing column."""
    fmt = config.format
    if fmt == "auto":
        if "problem" in columns or "answer" in columns:
            fmt = "polaris"
        elif "prompt" in columns:
            fmt = "dapo17k"
        else:
            raise ValueError(
                f"{config.path}: cannot detect the format from columns {columns}; expected "
                "DAPO-Math-17k (prompt + reward_model or solution) or Polaris (problem + answer)"
            )
    if fmt == "polaris":
        required = ["problem", "answer"]
    elif "solution" in columns or "prompt" not in columns:
        required = ["prompt", "solution"]
    else:
        required = ["prompt", "reward_model"]
    for column in required:
        if column not in columns:
            alternative = " (or 'solution')" if column == "reward_model" else ""
            raise ValueError(
                f"{config.path}: missing column {column!r}{alternative} required by format "
                f"{fmt!r} (columns: {columns})"
            )
    return fmt


def render_prompt(messages: list[dict[str, str]], tokenizer, *, template: str,
                  enable_thinking: bool | None = None) -> str:
    """Chat messages -> prompt text: the tokenizer's chat template, or the plain template."""
    if template == "plain":
        problem = "\n\n".join(m["content"] for m in messages)
        return PLAIN_TEMPLATE.replace("{problem}", problem)
    options = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **options
    )


def eos_ids(tokenizer) -> list[int]:
    """Ids that end a response: the tokenizer's EOS plus Qwen's end-of-turn and end-of-text
    tokens when the vocabulary has them (trainer and evaluator stop on the same set)."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} - {None}
    ids |= {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; generation could never stop")
    return sorted(ids)


def load_prompts(config: DataConfig, tokenizer) -> PromptDataset:
    """Read, validate, deduplicate, template and tokenize a prompt file."""
    if config.template == "chat" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"template='chat' but tokenizer {name!r} has no chat template; "
            "use template='plain' for base models"
        )
    table = _read_rows(config)
    fmt = _resolve_format(config, list(table.column_names))
    reward_rule = config.reward_rule or ("dapo" if fmt == "dapo17k" else "boxed")
    if config.prompt_suffix is not None:
        suffix = config.prompt_suffix
    else:
        suffix = POLARIS_SUFFIX if fmt == "polaris" else ""
    parse_row = _polaris_row if fmt == "polaris" else _dapo_row

    stats = dict.fromkeys(
        ("rows_read", "duplicates_dropped", "too_long", "no_answer", "malformed",
         "empty_prompt", "empty_row", "kept") + FLOAT_ANSWER_COUNTS,
        0,
    )  # fmt: skip
    seen: set[str] = set()
    texts, truths, conversions = [], [], []
    for batch in _batches(table, config.path):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            stats["rows_read"] += 1
            if all(v is None for v in values):  # `{}` (every field missing or null)
                stats["empty_row"] += 1
                continue
            try:
                messages, truth, converted = parse_row(dict(zip(columns, values)), suffix)
            except Skip as skip:
                stats[skip.reason] += 1
                continue
            key = "\x00".join(m["content"] for m in messages)  # the prompt text
            if key in seen:
                stats["duplicates_dropped"] += 1
                continue
            seen.add(key)
            texts.append(render_prompt(messages, tokenizer, template=config.template, enable_thinking=config.enable_thinking))
            truths.append(truth)
            conversions.append(converted)

    # Chat templates write their own special tokens; a plain prompt gets the tokenizer's
    # usual ones (a BOS for models that expect one).
    add_special = config.template == "plain"
    dataset = PromptDataset([], [], [], reward_rule, stats, source=config.path)
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = texts[start : start + _TOKENIZE_CHUNK]
        ids_chunk = tokenizer(chunk, add_special_tokens=add_special)["input_ids"]
        rows = zip(chunk, ids_chunk, truths[start : start + _TOKENIZE_CHUNK],
                   conversions[start : start + _TOKENIZE_CHUNK])
        for text, ids, truth, converted in rows:
            if len(ids) > config.max_prompt_tokens:
                stats["too_long"] += 1
                continue
            dataset.prompt_ids.append(list(ids))
            dataset.prompts_text.append(text)
            dataset.ground_truths.append(truth)
            if converted is not None:
                stats[converted] += 1
    stats["kept"] = len(dataset.prompt_ids)
    log.info("loaded %s (%s, reward %s): %s", config.path, fmt, reward_rule, stats)
    if not dataset.prompt_ids:
        raise ValueError(f"{config.path}: no usable prompts ({stats})")
    if stats["empty_row"]:
        log.warning("%s: %d of %d rows are empty objects {} (no field set): skipped",
                    config.path, stats["empty_row"], stats["rows_read"])
    return dataset


class PromptIterator:
    """Batches of prompt indices, reshuffled each epoch by (seed, epoch); resumable.

    Each epoch is a fresh permutation from `np.random.default_rng([seed, epoch])`, cut into
    full batches; the incomplete tail is dropped (every batch has the same shape, and the
    next epoch's shuffle gives those items their turn).
    """

    def __init__(self, num_items: int, batch_size: int, seed: int):
        if batch_size <= 0 or num_items < batch_size:
            raise ValueError(f"need 0 < batch_size <= num_items, got {batch_size}, {num_items}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.epoch, self.position = 0, 0  # position: items of this epoch already served
        self._perm_epoch, self._perm = -1, np.empty(0, np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_items), self.epoch
        return self._perm

    def next_batch(self) -> np.ndarray:
        """The next `batch_size` indices (int64)."""
        if self.position + self.batch_size > self.num_items:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position
        self.position += self.batch_size
        return self._permutation()[start : self.position].astype(np.int64)

    def state(self) -> dict[str, int]:
        """JSON-serializable position; `restore` of it continues the same sequence."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
        }

    def restore(self, state: dict[str, int], *, adapt: bool = False) -> None:
        """Continue from a `state()`; the seed and item count must match this iterator's,
        unless `adapt` (a resume that accepted changed data or seed: the same epoch and
        position in this iterator's order, the position cut to its item count)."""
        if adapt:
            self.epoch = int(state["epoch"])
            self.position = min(int(state["position"]), self.num_items)
            return
        for key in ("seed", "num_items"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"iterator state has {key}={state[key]} but this iterator has "
                    f"{getattr(self, key)}: the data or seed changed since the checkpoint"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
