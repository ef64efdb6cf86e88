"""README's agent (`my_pkg.agent`, a sketch) in the doc commands' runs (tests/fixtures/doc_commands.py).

As a function (`tests.integration.command_agent:run`), the calculator agent. As a command (`python -m
tests.integration.command_agent`), an agent that needs no SDK, as one in any language could be: one chat
request with the row's prompt to its session's URL (MEGAGRPO_BASE_URL, MEGAGRPO_ROW_FILE, OPENAI_API_KEY), then `null` on the
last line, which leaves the score to `rewards.functions`. Standard library only: the command starts once per
trajectory, and the openai client's import alone costs about 1.7 s of CPU.
"""

from __future__ import annotations

import json
import os
import urllib.request


def run(base_url: str, row: dict, **options) -> float:
    """The calculator agent (imported here: the command's process has no use for it)."""
    from megagrpo.envs.calculator_agent import run as calculator_agent

    return calculator_agent(base_url, row, **options)


def ask_once(base_url: str, row: dict, key: str | None = None) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": str(row["prompt"])}]}).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as reply:
        json.load(reply)  # an answer, not an error page


if __name__ == "__main__":
    with open(os.environ["MEGAGRPO_ROW_FILE"]) as f:
        row = json.load(f)
    ask_once(os.environ["MEGAGRPO_BASE_URL"], row, os.environ.get("OPENAI_API_KEY"))
    print("null")
