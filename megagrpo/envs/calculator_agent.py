"""The calculator task as an external agent would write it: a loop against the OpenAI client, run by the
agent endpoint (`rollout.multi_turn.agent.function: megagrpo.envs.calculator_agent:run`; docs/agentic.md).

It holds the conversation the built-in `CalculatorEnv` holds (the same system prompt, question, tool schema
and tool messages, call ids as the endpoint gave them), so for the same model turns the endpoint records the
trajectory the built-in driver records; its reward is the environment's: 1 for an `<answer>` equal to the
row's answer. `openai` is imported when an agent runs, not with the environments.
"""

from __future__ import annotations

import json
from typing import Any

from megagrpo.envs.calculator import DEFAULT_SYSTEM_PROMPT, calculator_tool, evaluate, format_number
from megagrpo.rewards.extract import answer_tag
from megagrpo.rewards.verifiers import exact_match

MAX_TURNS = 4


def tool_schema() -> dict[str, Any]:
    """The calculator's OpenAI function schema, as `CalculatorEnv.tool_schemas()` gives it."""
    t = calculator_tool()
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
    }


def answer(call: dict[str, Any]) -> str:
    """The calculator's answer to one OpenAI tool call (an error in words, as the environment's tool says)."""
    name, arguments = call["function"]["name"], call["function"].get("arguments")
    if name != "calculator":
        return f"Error: unknown tool {name!r}; available: calculator"
    try:
        expression = json.loads(arguments or "{}").get("expression", "")
        return format_number(evaluate(expression))
    except (ValueError, AttributeError) as e:
        return f"Error: {e}"


def run(
    base_url: str,
    row: dict[str, Any],
    *,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    max_turns: int = MAX_TURNS,
    stream: bool = False,
) -> float:
    """One episode: ask, run the calculator for each tool call, stop at the first reply without one."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="megagrpo", max_retries=0)
    model = client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(row["prompt"])}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    content = ""
    for turn in range(max_turns):
        message = _complete(client, model, messages, stream)
        messages.append(message)
        content = message.get("content") or ""
        if answer_tag(content) is not None or not message.get("tool_calls") or turn + 1 == max_turns:
            break
        for call in message["tool_calls"]:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": call["function"]["name"],
                    "content": answer(call),
                }  # fmt: skip
            )
    if answer_tag(content) is None:
        return 0.0
    return float(exact_match(extract="answer_tag")("", content, row))


def _complete(client: Any, model: str, messages: list[dict], stream: bool) -> dict[str, Any]:
    """One assistant message as a dict the next request sends back, streamed or not."""
    kw = dict(model=model, messages=messages, tools=[tool_schema()])
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True)
    content, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            got = calls.setdefault(
                c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            got["function"]["name"] += c.function.name or ""
            got["function"]["arguments"] += c.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
