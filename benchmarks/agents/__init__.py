"""Agents: agent programs through the session gateway with partial rollout against slime's agent path; the gateway's
own cost, in process and as its clients see it.

    python -m benchmarks.agents [--size small|default] [--seed N] [--out DIR]     # run.py
    python -m benchmarks.agents.gateway [--out FILE]
    python -m benchmarks.agents.gateway_live [--parts body tools stream] [--out FILE]

farm.py runs the agents in a process of their own; gateway_host.py a gateway in a process of its own.
"""
