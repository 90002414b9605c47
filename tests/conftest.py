"""Shared fixtures: the real Qwen tokenizer and VL processor (built once per session), the chat-template
fixtures, and anyio's pytest plugin on asyncio; the SGLang tier collected last."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """The SGLang tier last, in its collected order: the session's SGLang servers, once started, keep the
    CPU busy until the session ends, and the timing tests of the simulated server must not run beside them."""
    items.sort(key=lambda item: item.get_closest_marker("sglang") is not None)


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


@pytest.fixture(scope="session")
def sglang_workers():
    """Two real SGLang servers on CPU serving the tiny Qwen2.5-VL model, for the session (started side by
    side). They log every request received as JSON, routing key included, so a test can tell which server
    served which trajectory. Skips (fails under TURNSTILE_REQUIRE_SGLANG=1) without the SGLang venv."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.sglang_cpu.server import LOG_REQUESTS, SGLangServer, SGLangUnavailable, is_installed, model_dir, venv_dir

    if not is_installed():
        reason = f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install`"
        if os.environ.get("TURNSTILE_REQUIRE_SGLANG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    servers = [SGLangServer(model_dir("tiny-qwen2.5-vl"), extra=LOG_REQUESTS) for _ in range(2)]
    with ThreadPoolExecutor(len(servers)) as pool:
        started = [pool.submit(server.start) for server in servers]
    try:
        for future in started:
            future.result()
    except SGLangUnavailable as error:
        for server in servers:
            server.stop()
        pytest.fail(str(error))
    yield servers
    for server in servers:
        server.stop()
