"""Tokenizers for the model-family chat-template fixtures (tests/fixtures/chat_templates): the embedded Qwen
vocabulary, the model's own template, and the model's added tokens with their special flags and its EOS, as
`special_tokens.json` there lists them (SOURCES.md says where each was read)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from engine.models import load_tokenizer

FAMILY_TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOKENS = json.loads((FAMILY_TEMPLATES / "special_tokens.json").read_text())
NAMES = sorted(path.stem for path in FAMILY_TEMPLATES.glob("*.jinja"))


@functools.cache
def family_tokenizer(name: str) -> Any:
    """A tokenizer as the model's own would split its template's control tokens (cached: do not change it)."""
    entry = TOKENS[f"{name}.jinja"]
    tokenizer = load_tokenizer("qwen2.5", chat_template=(FAMILY_TEMPLATES / f"{name}.jinja").read_text())
    added_vocab = tokenizer.get_added_vocab()  # not get_vocab(): Qwen has `<s>` and `</s>` as plain BPE tokens
    added = [token for token in entry["added_tokens"] if token["content"] not in added_vocab]
    special = [token["content"] for token in added if token["special"]]
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": special}, replace_extra_special_tokens=False)
    tokenizer.add_tokens([token["content"] for token in added if not token["special"]])
    for key in ("eos_token", "bos_token"):
        if entry.get(key):
            setattr(tokenizer, key, entry[key])
    return tokenizer
