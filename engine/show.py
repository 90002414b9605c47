"""`turnstile show FILE`: the trajectories of a JSON lines file (what `turnstile run` writes), as a person
reads them: each one's status, stop reason, reward and errors, then its turns, the model's text and the
environment's marked apart (in colour on a terminal).

    turnstile show out/trajectories.jsonl                  # every trajectory
    turnstile show out/trajectories.jsonl --id 3           # one of them
    turnstile show out/trajectories.jsonl --status failed  # the failed ones, with their tracebacks

The text is the file's own (`prompt_text`, each turn's `response_text` and `observation_text`); a file
written with `--no-text` is decoded with `--tokenizer` when one is given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from engine.source import json_lines

MODEL, ENV, PROMPT, FAILED = "green", "cyan", "dim", "bold red"
STATUS_STYLE = {"completed": "bold green", "truncated": "yellow", "aborted": "yellow", "failed": FAILED}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a JSON lines file of trajectories (turnstile run's --out)")
    parser.add_argument("--id", type=int, action="append", help="only the trajectory with this id (may repeat)")
    parser.add_argument("--status", help="only trajectories of this status (completed, truncated, aborted, failed)")
    parser.add_argument(
        "--tokenizer", help="decode the tokens of a file written without text (qwen2.5, or a tokenizer directory)"
    )


def main(args: argparse.Namespace) -> int:
    """0: printed (perhaps nothing matched, which it says); 2: bad input, with one error line."""
    try:
        records = list(_records(args.file))
        decode = _decoder(args.tokenizer) if args.tokenizer else None
    except (OSError, ValueError) as exc:
        print(f"turnstile: error: {exc}", file=sys.stderr)
        return 2
    chosen = [r for r in records if _wanted(r, args)]
    console = Console(highlight=False, soft_wrap=True)
    if not chosen:
        console.print(f"{args.file}: no trajectory{_filters(args)} (of {len(records)})", markup=False)
        return 0
    for record in chosen:
        console.print(render(record, decode))
    return 0


def render(record: dict[str, Any], decode: Callable[[Sequence[int]], str] | None = None) -> Text:
    """One trajectory: a header line, its prompt, its turns (the model's text, then the environment's), its errors."""
    out = Text()
    status = record.get("status", "?")
    out.append(f"trajectory {record.get('id')}", "bold")
    out.append(f" · group {record.get('group_id')}, member {record.get('index')} · ")
    out.append(f"{status} ({record.get('stop_reason')})", STATUS_STYLE.get(status, ""))
    out.append(f" · reward {record.get('reward')} · {len(record.get('turns', []))} turns")
    out.append(f" · {record.get('prompt_length')} prompt + {record.get('response_length')} response tokens\n")
    texts = _texts(record, decode)
    if texts is None:
        out.append("  (no text in this file, written with --no-text: give --tokenizer to decode its tokens)\n", "dim")
    else:
        out.append("prompt\n", "bold " + PROMPT)
        out.append(_indent(texts["prompt"]), PROMPT)
    for i, turn in enumerate(record.get("turns", [])):
        out.append(f"turn {turn.get('index')}", "bold")
        out.append(
            f" · model {turn.get('num_generated')} tokens, finish {turn.get('finish_reason')}"
            f" · env {turn.get('num_observation')} tokens · generate {turn.get('generate_seconds', 0):.2f}s,"
            f" env {turn.get('env_seconds', 0):.2f}s, queued {turn.get('queue_seconds', 0):.2f}s"
            f" · retries {turn.get('retries', 0)}\n",
            "dim",
        )
        if texts is not None:
            response, observation = texts["turns"][i]
            out.append("  model ▸\n", "bold " + MODEL)
            out.append(_indent(response), MODEL)
            if observation:
                out.append("  env ▸\n", "bold " + ENV)
                out.append(_indent(observation), ENV)
    for error in record.get("errors", []):
        where = "before the first turn" if error.get("turn") is None else f"turn {error.get('turn')}"
        out.append(f"error {error.get('class')} ({error.get('stage')}, {where}): ", FAILED)
        out.append(f"{error.get('message')}\n", "red")
        if error.get("traceback"):
            out.append(_indent(error["traceback"]), "red")
    return out


def _texts(record: dict[str, Any], decode: Callable[[Sequence[int]], str] | None) -> dict[str, Any] | None:
    """The prompt's text and each turn's (response, observation): the file's own, else decoded, else None."""
    turns = record.get("turns", [])
    if "prompt_text" in record:
        return {
            "prompt": record["prompt_text"],
            "turns": [(t.get("response_text", ""), t.get("observation_text", "")) for t in turns],
        }
    if decode is None:
        return None
    tokens, start = record.get("tokens", []), record.get("prompt_length", 0)
    pieces = []
    for turn in turns:
        begin = start + turn["start"]
        middle = begin + turn["num_generated"]
        pieces.append((decode(tokens[begin:middle]), decode(tokens[middle : middle + turn["num_observation"]])))
    return {"prompt": decode(tokens[:start]), "turns": pieces}


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" for line in (text.splitlines() or [""]))


def _records(path: str) -> Iterator[dict[str, Any]]:
    for where, record in json_lines(path):
        if not isinstance(record, dict) or "turns" not in record:
            raise ValueError(f"{where}: not a trajectory (turnstile run writes one per line)")
        yield record


def _wanted(record: dict[str, Any], args: argparse.Namespace) -> bool:
    return (args.id is None or record.get("id") in args.id) and (args.status in (None, record.get("status")))


def _filters(args: argparse.Namespace) -> str:
    said = [f"id {', '.join(map(str, args.id))}"] if args.id else []
    said += [f"status {args.status}"] if args.status else []
    return f" with {' and '.join(said)}" if said else ""


def _decoder(name: str) -> Callable[[Sequence[int]], str]:
    from engine.models import load_tokenizer

    tokenizer = load_tokenizer(name)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
