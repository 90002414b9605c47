"""Shared fixtures: the real Qwen tokenizer and VL processor (built once per session), the chat-template
fixtures, and anyio's pytest plugin on asyncio."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer():
    from engine.models import load_tokenizer

    return load_tokenizer("qwen2.5")


@pytest.fixture(scope="session")
def processor():
    from engine.models import load_processor

    return load_processor("qwen2.5-vl")


def chat_templates_dir() -> Path | None:
    """$TURNSTILE_FIXTURES/chat_templates, else ../shared/fixtures/chat_templates; None when neither exists."""
    root = os.environ.get("TURNSTILE_FIXTURES") or REPO.parent / "shared" / "fixtures"
    path = Path(root) / "chat_templates"
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def templates_dir() -> Path:
    path = chat_templates_dir()
    if path is None:
        pytest.skip(
            "chat-template fixtures not found: set TURNSTILE_FIXTURES to a folder holding chat_templates/ "
            "(default ../shared/fixtures)"
        )
    return path
