"""Merging multimodal train inputs: re-concatenating every turn versus TrainInputBuffer's one merge.

    python -m benchmarks.micro mm_merge [--out FILE] [--repeats N] [--processes P]

Each turn adds the Qwen2.5-VL processor outputs of one 448x448 image: pixel_values (1024, 1176)
float32 (4.6 MiB) and image_grid_thw [[1, 32, 32]]. Two strategies, for 5, 10, 20 and 40 turns:

    per_turn  the merged tensors are re-concatenated with every new turn (bytes copied grow as turns^2)
    buffer    TrainInputBuffer: the turns are kept and joined once at the end, one torch.cat per key

Every case runs in P fresh subprocesses, N merges each. Time is the median of the P*N merges, and
the fastest. Peak memory is how far a process's peak RSS (VmHWM, reset before each merge through
/proc/self/clear_refs) rises above its RSS with the turns' inputs already in memory, i.e. what the
merge allocates at its worst moment; the largest of the P*N is reported. Two figures follow from
the shapes alone: bytes copied (written by torch.cat) and the bytes the merge must hold at once
(per_turn: the previous and the new merged tensors, (2T-1) turns' worth; buffer: T turns' worth).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import emit
from engine.multimodal import TrainInputBuffer

TURN_COUNTS = (5, 10, 20, 40)
PIXEL_SHAPE = (1024, 1176)
GRID = [1, 32, 32]
MB = 1024 * 1024
TURN_BYTES = 4 * PIXEL_SHAPE[0] * PIXEL_SHAPE[1] + 8 * len(GRID)
ROOT = Path(__file__).resolve().parents[2]


def turn_inputs(num_turns: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"pixel_values": torch.rand(PIXEL_SHAPE, generator=generator), "image_grid_thw": torch.tensor([GRID])}
        for _ in range(num_turns)
    ]


def merge_per_turn(turns: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], int]:
    merged: dict[str, torch.Tensor] = {}
    copied = 0
    for inputs in turns:
        for key, value in inputs.items():
            if key in merged:
                merged[key] = torch.cat([merged[key], value], dim=0)
                copied += merged[key].nbytes
            else:
                merged[key] = value
    return merged, copied


def merge_once(turns: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], int]:
    buffer = TrainInputBuffer()
    for inputs in turns:
        buffer.add(inputs)
    merged = buffer.merge()
    return merged, sum(value.nbytes for value in merged.values())


STRATEGIES = {"per_turn": merge_per_turn, "buffer": merge_once}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS; returns that RSS in kB."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def run_case(strategy: str, num_turns: int, repeats: int) -> dict:
    """One case, in this process (the parent calls it in a fresh subprocess)."""
    turns = turn_inputs(num_turns)
    merge = STRATEGIES[strategy]
    seconds, peaks = [], []
    for _ in range(repeats):
        base_kb = _reset_peak_rss()
        start = time.perf_counter()
        merged, copied = merge(turns)
        seconds.append(time.perf_counter() - start)
        peaks.append(_status_kb("VmHWM") - base_kb)
        assert merged["pixel_values"].shape[0] == num_turns * PIXEL_SHAPE[0]
        del merged
    return {"seconds": seconds, "peak_kb": peaks, "copied": copied}


def measure(strategy: str, num_turns: int, repeats: int, processes: int) -> dict:
    """The case in `processes` fresh subprocesses, summarised."""
    module = "benchmarks.micro.mm_merge"  # this module, one case in a fresh process
    command = [sys.executable, "-m", module, "--case", strategy, str(num_turns), f"--repeats={repeats}"]
    runs = [
        json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
        for _ in range(processes)
    ]
    seconds = [s for run in runs for s in run["seconds"]]
    held_turns = 2 * num_turns - 1 if strategy == "per_turn" else num_turns
    return {
        "median_ms": round(statistics.median(seconds) * 1e3, 1),
        "min_ms": round(min(seconds) * 1e3, 1),
        "peak_rss_growth_mib": round(max(p for run in runs for p in run["peak_kb"]) / 1024, 1),
        "held_at_once_mib": round(held_turns * TURN_BYTES / MB, 1),
        "bytes_copied_mib": round(runs[0]["copied"] / MB, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--repeats", type=int, default=5, help="merges per subprocess")
    parser.add_argument("--processes", type=int, default=3, help="fresh subprocesses per case")
    parser.add_argument("--case", nargs=2, metavar=("STRATEGY", "TURNS"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.case:
        print(json.dumps(run_case(options.case[0], int(options.case[1]), options.repeats)))
        return
    report = {
        "per_turn_inputs": {"pixel_values": list(PIXEL_SHAPE), "dtype": "float32", "image_grid_thw": [GRID]},
        "turn_mib": round(TURN_BYTES / MB, 2),
        "processes": options.processes,
        "repeats": options.repeats,
        "torch_threads": torch.get_num_threads(),
        "cases": [],
    }
    for num_turns in TURN_COUNTS:
        case = {"turns": num_turns} | {s: measure(s, num_turns, options.repeats, options.processes) for s in STRATEGIES}
        per_turn, buffer = case["per_turn"], case["buffer"]
        case["time_ratio"] = round(per_turn["median_ms"] / buffer["median_ms"], 1)
        case["copied_ratio"] = round(per_turn["bytes_copied_mib"] / buffer["bytes_copied_mib"], 1)
        report["cases"].append(case)
    emit(report, options.out)


if __name__ == "__main__":
    main()
