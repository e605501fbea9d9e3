"""The agent endpoint (rl/agent/endpoint.py) driven by the `openai` client: a multi-turn tool episode
of the built-in toolcalc task in the default model's plain format, streaming and not; rewritten
histories as branches; every fault an OpenAI-shaped error the client raises as its own exception.
The backend behind it is a scripted stand-in here (what is tested is the endpoint and the tree)."""

import json

import pytest

openai = pytest.importorskip("openai")  # the extras `agent` and `agent-test` (.ci/run installs them)
pytest.importorskip("fastapi")

from agents_for_tests import ADD, Scripted  # noqa: E402

from backstream.default_model import load_default  # noqa: E402
from backstream.rl.agent.endpoint import Endpoint  # noqa: E402
from backstream.rl.agent.turns import PlainFormat  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return load_default()[1]


def _endpoint(tok, turns, **kw) -> tuple[Endpoint, Scripted]:
    policy = Scripted(tok, turns)
    ep = Endpoint(lambda tools: PlainFormat(tok, tools), policy, tok.eos_token_id, max_new_tokens=32, **kw)
    ep.start()
    return ep, policy


def _agent(client, stream: bool) -> list[dict]:
    """A tool-using agent as people write them: call the model, run its tool calls, send the results."""
    messages = [{"role": "user", "content": "12+34+56="}]
    for _ in range(5):
        if stream:
            parts = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD], stream=True))
            delta = parts[0].choices[0].delta
            finish = parts[-1].choices[0].finish_reason
            message = {"role": "assistant", "content": delta.content}
            calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                     for c in delta.tool_calls or []]
        else:
            choice = client.chat.completions.create(model="policy", messages=messages, tools=[ADD]).choices[0]
            finish, message = choice.finish_reason, {"role": "assistant", "content": choice.message.content}
            calls = [c.model_dump() for c in choice.message.tool_calls or []]
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
        if finish != "tool_calls":
            return messages
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(args["a"] + args["b"])})
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_client_agent_plays_a_tool_episode_on_one_branch(tok, stream):
    ep, policy = _endpoint(tok, ["[add 12 34]", "[add 46 56]", "102"])
    try:
        session = ep.open()
        client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["policy"]
        messages = _agent(client, stream)
        assert messages[-1] == {"role": "assistant", "content": "102"}
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 12, "b": 34}
        t = ep.finish(session)
    finally:
        ep.stop()
    # the agent appended: one branch, and its sampled tokens are exactly the three answers, each after
    # exactly the ids the policy was fed
    assert t.requests == 3 and t.divergences() == 0
    (b,) = t.branches
    eos = tok.eos_token_id
    text = tok.decode(b.ids)
    want = "12+34+56=[add 12 34]<eos>\n=46\n[add 46 56]<eos>\n=102\n102<eos>"
    assert text.replace(tok.decode([eos]), "<eos>").endswith(want)
    starts = [i for i in range(len(b.ids)) if b.sampled[i] and (i == 0 or not b.sampled[i - 1])]
    assert [b.ids[:s] for s in starts] == policy.fed
    assert sum(b.sampled) == sum(len(tok(x, add_special_tokens=False)["input_ids"]) + 1
                                 for x in ("[add 12 34]", "[add 46 56]", "102"))


def test_a_rewritten_history_is_a_branch(tok):
    ep, policy = _endpoint(tok, ["[add 12 34]", "[add 46 56]", "102"])
    try:
        session = ep.open()
        client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
        first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34+56="}],
                                               tools=[ADD]).choices[0]
        call = first.message.tool_calls[0]
        # the agent summarises its history: the call and its result become one user note
        client.chat.completions.create(model="policy", tools=[ADD], messages=[
            {"role": "user", "content": "12+34+56="}, {"role": "user", "content": " so far 46"}])
        t = ep.finish(session)
    finally:
        ep.stop()
    assert call.function.name == "add" and t.divergences() == 1
    for fed, b in zip(policy.fed, t.branches):  # each answer after exactly what it was fed, trained there
        assert b.ids[:len(fed)] == fed and not any(b.sampled[:len(fed)]) and all(b.sampled[len(fed):])


def test_faults_are_errors_the_client_reads(tok):
    ep, _ = _endpoint(tok, ["7"] * 8, max_requests=2)
    try:
        session = ep.open()
        client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
        user = [{"role": "user", "content": "1+1="}]
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            openai.OpenAI(base_url=session.base_url, api_key="wrong", max_retries=0).chat.completions.create(
                model="policy", messages=user)
        with pytest.raises(openai.NotFoundError, match="serves 'policy'"):
            client.chat.completions.create(model="gpt-4o", messages=user)
        with pytest.raises(openai.BadRequestError, match="one completion per request"):
            client.chat.completions.create(model="policy", messages=user, n=2)
        with pytest.raises(openai.BadRequestError, match=r"temperature = 0.2: the run samples at rollout.temperature"):
            client.chat.completions.create(model="policy", messages=user, temperature=0.2)
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="policy", messages=[])
        ok = client.chat.completions.create(model="policy", messages=user, temperature=1.0)  # the run's: honoured
        assert ok.choices[0].message.content == "7"
        # a cut completion says so
        cut = client.chat.completions.create(model="policy", messages=user, max_tokens=1).choices[0]
        assert cut.finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="made its 2 requests"):
            client.chat.completions.create(model="policy", messages=user)
        ep.finish(session)
        with pytest.raises(openai.PermissionDeniedError, match="this episode is over"):
            client.chat.completions.create(model="policy", messages=user)
        import urllib.error
        import urllib.request

        other = ep.open()
        req = urllib.request.Request(other.base_url + "/chat/completions", data=b"{not json",
                                     headers={"Authorization": f"Bearer {other.key}",
                                              "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"
    finally:
        ep.stop()


def test_text_parts_are_the_string_and_other_content_is_refused(tok):
    """OpenAI's content parts ([{"type": "text", ...}]) render as the joined string; a message nested as
    content (a chat row's prompt passed as one message's content) is a 400 naming the fix, not the
    list's repr fed to the model."""
    ep, policy = _endpoint(tok, ["7"] * 4)
    try:
        session = ep.open()
        client = openai.OpenAI(base_url=session.base_url, api_key=session.key, max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}])
        parts = [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": parts}])
        assert policy.fed[1] == policy.fed[0]
        nested = [{"role": "user", "content": "12+34="}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content: .* pass it as `messages`"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": nested}])
        assert len(policy.fed) == 2  # the refused request sampled nothing
    finally:
        ep.stop()


def test_a_backend_failure_is_a_server_error_the_client_reads(tok):
    def broken(ids, max_tokens, seed, key=None):
        raise ConnectionError("the vLLM server died")

    ep = Endpoint(lambda tools: PlainFormat(tok, tools), broken, tok.eos_token_id)
    ep.start()
    try:
        s = ep.open()
        client = openai.OpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        with pytest.raises(openai.InternalServerError, match="the run's sampler failed: ConnectionError: the vLLM"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}])
    finally:
        ep.stop()


# A thinking model's template, as Qwen3's: an assistant turn keeps its reasoning (<think>...</think>)
# while it is the last one, and loses it once the conversation goes on
THINKING = ("{%- for m in messages -%}"
            "{%- if m.role == 'assistant' -%}"
            "{%- set c = m.content or '' -%}"
            "{%- if not loop.last and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
            "A:{{ c }}{{ eos_token }}"
            "{%- else -%}U:{{ m.content }}{%- endif -%}"
            "{%- endfor -%}{%- if add_generation_prompt -%}A:{%- endif -%}")


def test_a_template_that_strips_earlier_reasoning_trains_as_branches(tok):
    """Under Qwen3's rule the second request does not extend what was sampled (the reasoning is gone):
    no refusal, a branch; the reasoning tokens are trained on the first branch, after exactly the
    ids that were fed, and the second answer on the second, after the stripped history."""
    import copy

    from backstream.rl.agent.turns import ChatFormat

    chat_tok = copy.copy(tok)
    chat_tok.chat_template = THINKING
    eos = {tok.eos_token_id}
    policy = Scripted(tok, ["<think>1+1</think>2", "<think>2+2</think>4"])
    ep = Endpoint(lambda tools: ChatFormat(chat_tok, tools, eos, check=False), policy, tok.eos_token_id,
                  max_new_tokens=32)
    ep.start()
    try:
        s = ep.open()
        client = openai.OpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
        messages = [{"role": "user", "content": "1+1="}]
        first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        assert first == "<think>1+1</think>2"
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "2+2="}]
        second = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        t = ep.finish(s)
    finally:
        ep.stop()
    assert second == "<think>2+2</think>4" and t.divergences() == 1
    render = [tok.decode(b.ids) for b in t.branches]
    assert render[0] == "U:1+1=A:<think>1+1</think>2<eos>"
    assert render[1] == "U:1+1=A:2<eos>U:2+2=A:<think>2+2</think>4<eos>"  # the stripped history, as context
    for fed, b in zip(policy.fed, t.branches):
        assert b.ids[:len(fed)] == fed and not any(b.sampled[:len(fed)]) and all(b.sampled[len(fed):])


# THINKING with the tools' names rendered before the conversation: a template that renders tools
WITH_TOOLS = ("{%- if tools -%}T:{%- for t in tools -%}{{ t.function.name }};{%- endfor -%}{%- endif -%}"
              + THINKING)


def test_tools_that_the_chat_template_drops_are_refused(tok):
    """A template without a `tools` variable (SmolLM2's) renders a request the same with its tools as
    without: a 400 whose message names the template, the tools and the fix, and the episode counts the
    refusal; a template that renders them, a request without tools and tool_choice "none" are answered."""
    import copy

    from backstream.rl.agent.turns import ChatFormat

    eos = {tok.eos_token_id}
    for template, refused in ((THINKING, True), (WITH_TOOLS, False)):
        chat_tok = copy.copy(tok)
        chat_tok.chat_template = template
        policy = Scripted(tok, ["2"] * 4)
        ep = Endpoint(lambda tools, t=chat_tok: ChatFormat(t, tools, eos, check=False), policy, tok.eos_token_id,
                      max_new_tokens=8)
        ep.start()
        try:
            s = ep.open()
            client = openai.OpenAI(base_url=s.base_url, api_key=s.key, max_retries=0)
            user = [{"role": "user", "content": "1+1="}]
            if refused:
                with pytest.raises(openai.BadRequestError, match=r"tools \(add\) are not in the prompt: the chat "
                                   r"template of .* renders the conversation the same .* data.format / env.format "
                                   r"= \"plain\"") as e:
                    client.chat.completions.create(model="policy", messages=user, tools=[ADD])
                assert e.value.code == "tools_not_rendered" and s.refused == {"tools_not_rendered": 1}
                assert policy.fed == []  # nothing was sampled for it
            else:
                client.chat.completions.create(model="policy", messages=user, tools=[ADD])
                assert tok.decode(policy.fed[-1]).startswith("T:add;")
            client.chat.completions.create(model="policy", messages=user)
            client.chat.completions.create(model="policy", messages=user, tools=[ADD], tool_choice="none")
            assert len(policy.fed) == (2 if refused else 3)
        finally:
            ep.stop()


def test_an_openai_agents_sdk_agent_plays_a_tool_episode(tok):
    """The OpenAI Agents SDK (its Runner, a function tool, chat completions) drives a three-request tool
    episode: its calls come back as tool calls it runs, its history extends one branch."""
    pytest.importorskip("agents")
    import asyncio

    from agents_for_tests import sdk_agent

    ep, policy = _endpoint(tok, ["[add 12 34]", "[add 46 56]", "102"])
    try:
        s = ep.open()
        asyncio.run(sdk_agent(s.base_url, s.key, "policy", {"prompt": "12+34+56="}))
        t = ep.finish(s)
    finally:
        ep.stop()
    assert t.requests == 3 and t.divergences() == 0 and s.tool_calls == 2
    assert tok.decode(t.branches[0].ids).endswith("=102\n102<eos>")
    assert s.conversation[-1] == {"role": "assistant", "content": "102", "finish_reason": "stop"}
