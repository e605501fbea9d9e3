"""Agent programs and a scripted policy for the endpoint's tests (tests/rl/agent/test_endpoint.py,
test_agent_runner.py): agents written with the `openai` client, as users write them."""

import json
import time

import torch

from backstream.rl.records import Completion

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


class Scripted:
    """A policy that answers with the next of `turns` (text), each ended by EOS; records what it was fed."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.fed = tok, list(turns), []

    def __call__(self, ids: list[int], max_tokens: int, seed: int, key: str | None = None) -> Completion:
        self.fed.append(list(ids))
        out = self.tok(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        out = out[:max_tokens]
        reason = "eos" if out[-1] == self.tok.eos_token_id else "length"
        return Completion(out, torch.full((len(out),), -0.25), torch.full((len(out),), 7), reason)


def _messages(row) -> list[dict]:
    """The row's prompt as a conversation: a chat-format row's prompt is one already (TRL's form)."""
    return [dict(m) for m in row["prompt"]] if isinstance(row["prompt"], list) else [
        {"role": "user", "content": row["prompt"]}]


def calculator_agent(base_url, api_key, model, row):
    """Solve `row["prompt"]` with the add tool; the reward: 1 if the final answer is `row["answer"]`."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = _messages(row)
    for _ in range(4):
        choice = client.chat.completions.create(model=model, messages=messages, tools=[ADD]).choices[0]
        message = {"role": "assistant", "content": choice.message.content}
        if not choice.message.tool_calls:
            return float(choice.message.content.strip() == row["answer"])
        message["tool_calls"] = [c.model_dump() for c in choice.message.tool_calls]
        messages.append(message)
        for c in choice.message.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    return 0.0


async def async_agent(base_url, api_key, model, row):
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    answer = await client.chat.completions.create(model=model, messages=_messages(row))
    return 0.5 if answer.choices[0].message.content else None


def raising_agent(base_url, api_key, model, row):
    raise KeyError("no such tool")


def sleeping_agent(base_url, api_key, model, row):
    time.sleep(30)


def rewriting_agent(base_url, api_key, model, row):
    """Three requests that rewrite their history as agents do: the first answer is sent back wrapped
    as reasoning (`<think>…</think>ok`, which a thinking template strips once the conversation goes
    on), the second as it came, the third after the agent summarised the whole history into one
    note. Its reward: the share of vowels-free characters of the last answer (any number will do)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = _messages(row)
    answer = ""
    for turn in range(3):
        if turn == 2:  # a summary replaces the history
            messages = [*_messages(row), {"role": "user", "content": "so far: ok"}]
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=5).choices[0].message
        answer = answer.content or ""
        messages += [{"role": "assistant", "content": f"<think>{answer}</think>ok" if turn == 0 else answer},
                     {"role": "user", "content": "more"}]
    return sum(ch not in "aeiou" for ch in answer) / max(1, len(answer))


def failing_agent(base_url, api_key, model, row):
    """One request, then a raise (its episode: reward 0, counted) for odd prompts' second episodes."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=_messages(row), max_tokens=3)
    if "1" in _messages(row)[-1]["content"]:
        raise RuntimeError("the agent's own bug")
    return 1.0


async def sdk_agent(base_url, api_key, model, row):
    """The OpenAI Agents SDK's agent loop (Runner) with one function tool, add, on the endpoint's chat
    completions; returns None (the run's reward functions score the final answer)."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent anywhere

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(name="calc", tools=[add], model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    result = await Runner.run(agent, row["prompt"], max_turns=4)
    assert isinstance(result.final_output, str)
    return None


def appending_agent(base_url, api_key, model, row):
    """Four requests, each the whole conversation so far plus a user note: every request extends the
    last one's ids (in the plain format)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = _messages(row)
    for _ in range(4):
        answer = client.chat.completions.create(model=model, messages=messages).choices[0]
        messages += [{"role": "assistant", "content": answer.message.content or ""},
                     {"role": "user", "content": "go on"}]
    return 0.0


def _screen_url(k: int) -> str:
    """Screen k (envs_for_tests._screen) as a PNG data URL."""
    import base64
    import io

    from envs_for_tests import _screen

    buf = io.BytesIO()
    _screen(k).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _shot(k: int, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _screen_url(k)}},
                                        {"type": "text", "text": text}]}


def screenshot_agent(base_url, api_key, model, row):
    """Screenshots as `image_url` parts, as a GUI agent sends them: screen 1, then the answer and screen
    2; then a rewritten history that re-sends screen 1 and its answer with screen 3 instead. Reward: the
    last answer's length (any number will do)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def ask(messages):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=4).choices[0].message.content

    first = [_shot(1, "red?")]
    a1 = ask(first) or ""
    ask([*first, {"role": "assistant", "content": a1}, _shot(2, "blue?")])
    a3 = ask([*first, {"role": "assistant", "content": a1}, _shot(3, "green?")]) or ""
    return float(len(a3))


REFUSED: list = []  # what network_image_agent was told


def network_image_agent(base_url, api_key, model, row):
    """An http(s) image URL: the endpoint answers 400 naming the part (recorded in REFUSED)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    except openai.BadRequestError as e:
        REFUSED.append((e.status_code, e.body))
    return 0.0
