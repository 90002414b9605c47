"""Scale: many simulated servers under three placement policies and the turn rate at which one engine process
saturates; rollout shards; the engine's CPU per turn against a trajectory's history.

    python -m benchmarks.scale --servers 64 --out DIR [--size full|shared|smoke]     # run.py
    python -m benchmarks.scale.shards [--shards 1 2] [--out FILE]
    python -m benchmarks.scale.context_cost [--contexts ...] [--out FILE]
"""
