"""The long-tail benchmark: slime-style rollout against Turnstile's turn-level scheduler, with and without partial
rollout, on a simulated SGLang server; and that server, which the other benchmarks run against too.

    python -m benchmarks.longtail --size small|large --out DIR     # run.py: throughput, utilization, staleness, plots
    python -m benchmarks.longtail.simserver --port 0               # the simulated server alone

run.py runs the policies (slime.py, turnstile.py) on the workload (workload.py); common.py holds what they share,
report.py the report's table and plots; simserver.py is the server (`sim_server()` starts it in a process of its
own), model.py its deterministic model.
"""
