"""An agent program, written with the `openai` client as any agent is, that backstream trains through
its OpenAI-compatible endpoint (docs/agentic.md, "Agent programs"). It solves the built-in toolcalc
task ("12+34+56=") with one tool, add(a, b): it asks the model, runs the tool calls the model makes,
sends the results back, and stops at the first answer. Copy it and put your own loop in its place.

    backstream train examples/toolcalc_agent.toml

backstream calls `agent(base_url, api_key, model, row)` once per episode, G episodes per task at once;
`row` is the task's row (here {"prompt": "12+34+56=", "answer": "102", ...}). Returning None leaves the
reward to the run's reward functions (toolcalc's exact match on the final answer); return a number to
score the episode yourself (the reward "env").
"""

import json

from openai import DefaultHttpxClient, OpenAI

# One HTTP client for every episode (it is thread-safe): building one per OpenAI() costs ~20 ms of
# CPU (its TLS context), which 64 concurrent episodes pay on the trainer's cores at every step
HTTP = DefaultHttpxClient()

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add(a: int, b: int) -> int:
    return int(a) + int(b)


def agent(base_url: str, api_key: str, model: str, row: dict):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)
    # a chat-format row's prompt is a conversation already (TRL's form); a plain one is text
    prompt = row["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for _ in range(4):  # the run allows env.max_turns requests
        choice = client.chat.completions.create(model=model, messages=messages, tools=[ADD]).choices[0]
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return None  # an answer (or a turn cut by the token limit): the reward functions score it
        for call in message.tool_calls:
            try:
                result = str(add(**json.loads(call.function.arguments)))
            except (TypeError, ValueError) as e:  # the model wrote a bad call: it reads the error
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
