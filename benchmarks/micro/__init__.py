"""Micro-benchmarks: one cost at a time (observation encoding, trajectory memory, the local backend's batching,
multimodal merges, scheduler overhead, the bridge, payloads, Ray calls, env workers, the sandbox, streaming).

    python -m benchmarks.micro                     # lists them, with what each measures
    python -m benchmarks.micro NAME [its flags]    # runs one (NAME --help: its flags)

Each is also a module of its own: `python -m benchmarks.micro.NAME` runs it the same way.
"""
