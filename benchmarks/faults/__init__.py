"""Fault injection: the long-tail workload and agent programs under injected faults, each case against its fault-free
baseline (no prompt may be lost); and a hung env under `turnstile run`.

    python -m benchmarks.faults --out DIR [--size smoke|small|large] [--faults NAME ...] [--sglang]
    python -m benchmarks.faults.hung_env [--out FILE]

suite.py runs the cases (their table, the data they share and each one's report entry are in cases.py); ray_case.py
runs the Ray cases, report.py writes report.md and faults.png. The processes it kills: servers.py (simulated
servers, sglang-router), sglang.py (real SGLang on CPU, with proxy.py injecting faults into its replies); env.py is
the workload's env by module path.
"""
