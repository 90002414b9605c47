"""An agent program for the agent-env tests, on the official `openai` SDK, unmodified: it asks its session (at
OPENAI_BASE_URL) about the weather with a tool, runs the tool, and sends the result back. How it ends is its
first argument:

    python -m tests.agents.program finish|compact|crash|hang|silent PIDFILE

`finish`: prints the final answer as JSON; `compact`: then asks once more with its history compacted into one
user message (a fork of its session); `crash`: says why on stdout and exits 3 after its first reply; `hang`:
never ends after its first reply; `silent`: exits 0 without a request. Before its first request it starts two
`sleep` processes, one in its process group and one that leaves it (`setsid`), and writes their pids (and its
own) to PIDFILE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def main(how: str, pid_file: str) -> None:
    children = [subprocess.Popen(["sleep", "600"]), subprocess.Popen(["setsid", "sleep", "600"])]
    with open(pid_file, "w") as out:
        json.dump([os.getpid(), *(child.pid for child in children)], out)
    if how == "silent":
        return
    client = openai.OpenAI(max_retries=0)
    messages = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "How is the weather in Paris?"},
    ]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    if how == "crash":
        print("Error: the agent's tool server went away")  # on stdout, as Claude Code's -p writes its errors
        sys.exit(3)
    if how == "hang":
        while True:
            time.sleep(60)
    messages.append(first.model_dump(exclude_none=True))
    for call in first.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C."})
    final = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    if how == "compact":
        summary = [messages[0], {"role": "user", "content": f"So far: {final.content} Anything else in Paris?"}]
        client.chat.completions.create(model="policy", messages=summary, tools=TOOLS)
    print(json.dumps({"final": final.content}))


if __name__ == "__main__":
    main(*sys.argv[1:])
