"""The real Qwen3 tokenizer loaded offline: known ids and the chat template's thinking switch.

Expected ids come from the tokenizer's own files (vocab.json, the added-token table): byte-level
BPE maps a space to 'Ġ' and a newline to 'Ċ', and Qwen's pre-tokenizer splits digits one by one.
"""

import json
import os

import pytest
from helpers_hf import qwen_tokenizer_dir

from ba_jax.models.convert_hf import load_tokenizer


@pytest.fixture(scope="module")
def files():
    path = qwen_tokenizer_dir()
    vocab = json.load(open(os.path.join(path, "vocab.json")))
    added = json.load(open(os.path.join(path, "tokenizer_config.json")))["added_tokens_decoder"]
    special = {t["content"]: int(i) for i, t in added.items()}
    return path, vocab, special


@pytest.fixture(scope="module")
def tok(files):
    return load_tokenizer(files[0])


def test_special_token_ids(tok, files):
    _, _, special = files
    assert special["<|im_start|>"] == 151644 and special["<|im_end|>"] == 151645
    assert special["<|endoftext|>"] == 151643
    assert special["<think>"] == 151667 and special["</think>"] == 151668
    for text, i in special.items():
        assert tok.encode(text, add_special_tokens=False) == [i], text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == 151643


def test_plain_text_ids(tok, files):
    _, vocab, _ = files
    assert tok.encode("Hello world", add_special_tokens=False) == [
        vocab["Hello"], vocab["Ġworld"]] == [9707, 1879]
    # digits split one by one; byte-level ids of '2', '+', '=' and '4'
    assert tok.encode("2+2=4", add_special_tokens=False) == [17, 10, 17, 28, 19]
    assert [vocab[c] for c in "2+=4"] == [17, 10, 28, 19]
    assert tok.decode([9707, 1879]) == "Hello world"


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_thinking_switch(tok, files, thinking):
    _, vocab, special = files
    messages = [{"role": "user", "content": "Hello world"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=thinking)
    prompt = "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    assert text == (prompt if thinking else prompt + "<think>\n\n</think>\n\n")
    nl, start, end = vocab["Ċ"], special["<|im_start|>"], special["<|im_end|>"]
    ids = [start, vocab["user"], nl, vocab["Hello"], vocab["Ġworld"], end, nl,
           start, vocab["assistant"], nl]
    if not thinking:
        ids += [special["<think>"], vocab["ĊĊ"], special["</think>"], vocab["ĊĊ"]]
    assert tok.encode(text, add_special_tokens=False) == ids
