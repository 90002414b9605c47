"""A streamed reply's pieces (engine/agents/streaming.py) for turns of templates no family names: the reasoning
and the content go out as they are generated, split by the template's own markers, and a call is held back from
its opener on; as for the engine's families."""

from __future__ import annotations

from engine.agents.streaming import StreamSplitter
from engine.encoding import ChatEncoder
from tests.family_fixtures import family_tokenizer


def streamed(encoder: ChatEncoder, text: str) -> list[tuple[str, str]]:
    """The pieces of `text` fed one token at a time."""
    split = StreamSplitter(encoder)
    ids = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [piece for token in ids for piece in split.feed([token])]


def joined(pieces: list[tuple[str, str]], kind: str) -> str:
    return "".join(text for k, text in pieces if k == kind)


def test_a_template_without_a_call_syntax_streams_its_reasoning_and_content_by_its_own_markers():
    thinking = ChatEncoder(family_tokenizer("MiniMaxAI-MiniMax-M3"), chat_template_kwargs={"thinking_mode": "enabled"})
    pieces = streamed(thinking, "I weigh the sky and the wind.</mm:think>It is sunny over the whole town today.")
    assert joined(pieces, "reasoning") == "I weigh the sky and the wind."
    assert "It is sunny over the whole town today.".startswith(joined(pieces, "content"))
    assert len([kind for kind, _ in pieces if kind == "content"]) > 3  # as generated, not whole at the end


def test_a_template_that_writes_no_reasoning_streams_everything_as_content():
    gemma = ChatEncoder(family_tokenizer("google-gemma-3-4b-it"))
    text = "<think>not a marker here</think> It is sunny."
    pieces = streamed(gemma, text)
    assert {kind for kind, _ in pieces} == {"content"} and len(pieces) > 3
    assert text.startswith(joined(pieces, "content"))


def test_a_probed_call_syntax_holds_the_call_back_from_its_opener():
    minicpm = ChatEncoder(family_tokenizer("openbmb-MiniCPM5-1B"))
    call = '<function name="calc"><param name="answer">42</param></function>'
    pieces = streamed(minicpm, f"<think>Add them.</think>Checking it now. {call}")
    assert joined(pieces, "reasoning") == "Add them."
    assert joined(pieces, "content") == "Checking it now."
    assert "<function" not in "".join(text for _, text in pieces)
