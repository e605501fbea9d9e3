"""How the turns of an episode become tokens, and tokens tool calls (docs/design.md §6d: token-level fidelity).

The sampled tokens of a turn are kept verbatim, never decoded and re-encoded into the sequence: the
sampler appends to what it already fed only the *new* part — the tool results, a user message and the
template's opening of the next turn — rendered on its own. So the sequence the engine trains is
bitwise the one the policy saw. (A chat template that renders earlier turns differently later, e.g.
one that drops earlier reasoning, would change a re-rendered conversation: the episode continues on
what the policy actually saw.)

- `ChatFormat`: the tokenizer's chat template, with the tools' schemas (`tools=`) in the prompt. A
  tool call is read with the tokenizer's own response parser where it defines one
  (`tokenizer.parse_response`), else as Hermes/Qwen-style `<tool_call>{"name": …, "arguments": {…}}
  </tool_call>` blocks. The tokens inserted after a turn are those the template renders after an
  assistant turn for the tool (or user) messages plus the next generation prompt: the difference
  between a short conversation rendered with and without them (TRL's way), cut at the end-of-turn
  token the policy sampled.
- `PlainFormat`: text for a model without a chat template (the built-in default model). A turn is a
  tool call when its text is `[name arg arg …]` (arguments in the order of the tool's parameters,
  JSON values where they parse); its result is inserted as "\n=result\n", a user message as
  "\n" + message + "\n"; any other turn is an answer.

A tool result or a user message may hold images (a screenshot): its content is then parts
(`{"type": "image"}`, `{"type": "text", ...}`), which the chat template renders (an image token per
image) or the plain format writes as `image_marker`; the episode's sampler then expands each image
token over its placeholders (rl/data/images.py `Pictures.expand`).
"""

from __future__ import annotations

import json
import os
import re

from backstream.checks import UserError
from backstream.rl.agent.env import ToolCall

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PLAIN_CALL = re.compile(r"\[\s*(\w+)((?:\s+[^\s\]]+)*)\s*\]")


class PlainFormat:
    """The default model's text format (see the module docstring)."""

    name = "plain"
    renders_tools = False  # a tool's schema is not written into the prompt: the prompt's text says what it is

    def __init__(self, tokenizer, schemas: list[dict]):
        self.tok = tokenizer
        self.params = {s["function"]["name"]: list(s["function"]["parameters"].get("properties", {}))
                       for s in schemas}

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt(self, prompt, extra: str | None) -> tuple[list[int], list[dict]]:
        """The episode's first tokens and its prompt as messages (for the reward functions); `prompt`
        None: the environment's reset text is the whole prompt."""
        if prompt is not None and not isinstance(prompt, str):
            raise UserError("env.format: 'plain' takes text prompts; chat prompts need a tokenizer with a chat "
                             "template (env.format = 'chat')")
        text = (prompt or "") + (extra or "")
        return self.tok(text, add_special_tokens=True)["input_ids"], [{"role": "user", "content": text}]

    def parse(self, ids: list[int]) -> tuple[dict, list[ToolCall]]:
        """The assistant message of a sampled turn and the tool calls it makes."""
        text = self.tok.decode(ids, skip_special_tokens=True)
        stripped = text.strip()
        if not self.params or not stripped.startswith("["):  # no tools: every turn is text
            return {"role": "assistant", "content": text}, []
        m = _PLAIN_CALL.fullmatch(stripped)
        if m is None:
            call = ToolCall(name="?", arguments=[],
                            error=f"malformed tool call {stripped[:60]!r}; write [name arg ...]")
            return {"role": "assistant", "content": text}, [call]
        name, args = m.group(1), [_value(a) for a in m.group(2).split()]
        params = self.params.get(name)
        if params is not None and len(args) != len(params):
            call = ToolCall(name=name, arguments=args,
                            error=f"{name} takes {len(params)} argument(s) ({', '.join(params)}), got {len(args)}")
        else:
            call = ToolCall(name=name, arguments=dict(zip(params, args)) if params is not None else args)
        message = {"role": "assistant", "content": "", "tool_calls": [_as_message_call(call)]}
        return message, [call]

    image_marker = ""  # the text of one image (data/images.py `Pictures.marker`), set for a vision-language policy

    def _content(self, content) -> str:
        """A message's content as this format writes it: text, or parts whose images are `image_marker`."""
        if isinstance(content, str):
            return content
        return "".join(self.image_marker if p.get("type") == "image" else p.get("text", "") for p in content)

    def tool_results(self, results: list[tuple[str, str]]) -> list[int]:
        return self.encode("".join(f"\n={self._content(content)}\n" for _, content in results))

    def user(self, text) -> list[int]:
        return self.encode(f"\n{self._content(text)}\n")

    def conversation(self, messages: list[dict], eos: int) -> list[int]:
        """A whole conversation (an endpoint request: rl/agent/endpoint.py) as this format writes an
        episode: the first system/user messages' text as the prompt, then each assistant turn (a call as
        `[name arg ...]`, arguments in the order of the tool's parameters) ended by `eos`, a tool result as
        "\n=result\n", a later user message as "\n" + text + "\n"."""
        head = prompt_head(messages)
        ids = self.tok("".join(_text(m) for m in messages[:head]), add_special_tokens=True)["input_ids"]
        for m in messages[head:]:
            if m["role"] == "assistant":
                calls = [c["function"] for c in m.get("tool_calls") or []]
                text = _text(m) + "".join(f"[{c['name']} {' '.join(_plain_args(c, self.params))}]" for c in calls)
                ids += self.encode(text) + [eos]
            elif m["role"] == "tool":
                ids += self.tool_results([("", _text(m))])
            else:
                ids += self.user(_text(m))
        return ids


class ChatFormat:
    """The tokenizer's chat template (see the module docstring)."""

    name = "chat"
    renders_tools = True  # the tools' schemas are the template's to render (`tools=`)

    def __init__(self, tokenizer, schemas: list[dict], end_of_turn: set[int], template: str = "",
                 check: bool = True):
        """`check`: refuse now a template that renders earlier turns differently later (the in-process
        episode loop extends what it fed; an endpoint's requests take such a rewrite as a branch)."""
        self.template = _read_template(template) if template else None
        if self.template is None and getattr(tokenizer, "chat_template", None) is None:
            raise UserError("env.format: 'chat' needs a tokenizer with a chat template (or env.chat_template); use "
                             "env.format = 'plain' for a model without one")
        self.tok, self.schemas, self.end_of_turn = tokenizer, schemas, end_of_turn
        # special tokens that are not turn ends: a parser reads tool-call markers among them
        self.specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
        if check:
            self.check()

    def check(self) -> None:
        """Render a tool conversation (a call, its result, the next turn; a user message) through the
        template now, so that one which renders earlier turns differently once the conversation goes
        on is refused before the run rather than at its first tool call; and one that ignores `tools=`
        (renders a prompt the same with the tools' schemas as without), which would train a model that
        never sees its tools."""
        if self.schemas:
            probe = [{"role": "user", "content": "ok"}]
            if self.drops_tools(probe):
                names = [x["function"]["name"] for x in self.schemas]
                raise UserError(
                    f"env.format: {self.source} ignores the tools: it renders a prompt the same with their schemas "
                    f"({', '.join(names)}) as without, so the model would never see them. Set env.chat_template to a "
                    "template that renders tools= (a .jinja file or the template text), or env.format = \"plain\" "
                    "(tool calls as text turns \"[name arg ...]\")")
        try:
            for name in [s["function"]["name"] for s in self.schemas][:1] or [None]:
                if name is not None:
                    self.tool_results([(name, "1")])
            self.user("ok")
        except ValueError as e:
            raise UserError(f"{e}. The start-up check rendered a two-turn conversation through "
                             f"{'env.chat_template' if self.template else 'the tokenizer’s chat template'}; set "
                             "env.chat_template to a training template that renders earlier turns as they were "
                             "(TRL ships one for such families, e.g. Qwen3's, which drops earlier reasoning)") from None

    @property
    def source(self) -> str:
        """The template, as a user names it."""
        if self.template:
            return "env.chat_template"
        return f"the chat template of {getattr(self.tok, 'name_or_path', '') or 'the tokenizer'}"

    def drops_tools(self, messages: list[dict]) -> bool:
        """Whether the template renders `messages` the same with this format's tools as without: a
        template without a `tools` variable (SmolLM2's) drops their schemas, and the policy never sees
        them. False without tools."""
        return bool(self.schemas) and self._render(messages, True) == self._render(messages, True, tools=False)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: bool = True) -> list[int]:
        out = self.tok.apply_chat_template(messages, tools=(self.schemas or None) if tools else None, tokenize=True,
                                           add_generation_prompt=generation_prompt, return_dict=False,
                                           chat_template=self.template)
        return list(out[0] if out and isinstance(out[0], list) else out)

    def conversation(self, messages: list[dict], eos: int) -> list[int]:
        """A whole conversation, rendered by the template with the tools and the generation prompt (an
        endpoint request: rl/agent/endpoint.py; `eos` unused: the template ends its turns)."""
        return self._render(messages, True)

    def prompt(self, prompt, extra: str | None) -> tuple[list[int], list[dict]]:
        """`prompt` None: the environment's reset text is the task's one user message."""
        if prompt is None:
            messages = [{"role": "user", "content": ""}]
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if extra:  # appended to the task's last user message, where TRL puts it
            last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
            messages[last] = {**messages[last], "content": str(messages[last].get("content", "")) + extra}
        return self._render(messages, True), messages

    def parse(self, ids: list[int]) -> tuple[dict, list[ToolCall]]:
        if not self.schemas:  # no tools: every turn is text
            return {"role": "assistant", "content": self.tok.decode(ids, skip_special_tokens=True)}, []
        if getattr(self.tok, "response_schema", None) is not None or getattr(self.tok, "response_template", None):
            try:
                message = self.tok.parse_response(ids)
                calls = [ToolCall(name=c["function"]["name"], arguments=c["function"].get("arguments") or {})
                         for c in message.get("tool_calls") or []]
                return {"role": "assistant", **message}, calls
            except (ValueError, TypeError, KeyError) as e:  # a malformed call the parser refuses
                text = self.tok.decode(ids, skip_special_tokens=True)
                return {"role": "assistant", "content": text}, [ToolCall("?", {}, error=f"malformed tool call ({e})")]
        # tool-call markers may be special tokens: read them from the ids with the specials kept (but
        # the turn's end), the message's text without them
        text = self.tok.decode([t for t in ids if t not in self.end_of_turn], skip_special_tokens=False)
        calls = []
        for block in _HERMES.findall(text):
            try:
                obj = json.loads(block)
                args = obj.get("arguments", obj.get("parameters", {}))
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                    raise UserError("needs a name and an arguments object")
                calls.append(ToolCall(name=obj["name"], arguments=args))
            except (ValueError, AttributeError) as e:
                calls.append(ToolCall("?", {}, error=f"malformed tool call {block[:60]!r} ({e})"))
        rest = _HERMES.sub("", text)
        if "<tool_call>" in rest:  # opened, never closed: a malformed call, not an answer
            tail = rest[rest.index("<tool_call>"):]
            calls.append(ToolCall("?", {}, error=f"unclosed tool call {tail[:60]!r}; end it with </tool_call>"))
            rest = rest[: rest.index("<tool_call>")]
        for special in self.specials:
            rest = rest.replace(special, "")
        message = {"role": "assistant", "content": rest.strip()}
        if calls:
            message["tool_calls"] = [_as_message_call(c) for c in calls]
        return message, calls

    def _suffix(self, messages: list[dict], first_tool: str | None) -> list[int]:
        """The tokens the template renders for `messages` and the next generation prompt after an
        assistant turn, cut at the end-of-turn token the policy sampled."""
        call = [{"type": "function", "function": {"name": first_tool or "tool", "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        if first_tool is None:
            dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        prefix = self._render(dummy, False)
        full = self._render(dummy + messages, True)
        ends = [i for i, t in enumerate(prefix) if t in self.end_of_turn]
        if ends:  # the sampled turn ends at its end-of-turn token; what the template puts after it is ours
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise UserError("env.format: the chat template renders the conversation before the tool results "
                             "differently once they are added, so the inserted tokens cannot be cut out of it; use "
                             "a template that extends a conversation at its end")
        return full[len(prefix):]

    def tool_results(self, results: list[tuple[str, str]]) -> list[int]:
        return self._suffix([{"role": "tool", "name": n, "content": c} for n, c in results], results[0][0])

    def user(self, text: str) -> list[int]:
        return self._suffix([{"role": "user", "content": text}], None)


def make_format(kind: str, tokenizer, schemas: list[dict], end_of_turn: set[int], template: str = "",
                check: bool = True):
    """env.format → the format object ("auto": chat when the tokenizer has a chat template or
    env.chat_template gives one); `check`: ChatFormat's start-up check."""
    if kind == "auto":
        kind = "chat" if template or getattr(tokenizer, "chat_template", None) is not None else "plain"
    if kind == "chat":
        return ChatFormat(tokenizer, schemas, end_of_turn, template, check)
    return PlainFormat(tokenizer, schemas)


def prompt_head(messages: list[dict]) -> int:
    """How many leading messages are the prompt (system, developer and user ones, before any turn)."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer", "user"):
        head += 1
    return head


def _read_template(template: str) -> str:
    """env.chat_template: a .jinja file's text, or the template itself."""
    if template.endswith((".jinja", ".j2", ".txt")) and "{" not in template:
        if not os.path.isfile(template):
            raise UserError(f"env.chat_template: no file {template!r}")
        with open(template) as f:
            return f.read()
    return template


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(message: dict) -> str:
    """A message's content as text (OpenAI's list of parts joined)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _plain_args(function: dict, params: dict[str, list[str]]) -> list[str]:
    """A call's arguments (a JSON string or an object) as the plain format writes them."""
    args = function.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args or "{}")
    if isinstance(args, dict):
        order = params.get(function["name"], list(args))
        args = [args[k] for k in order if k in args]
    return [a if isinstance(a, str) else json.dumps(a) for a in args]


def _as_message_call(call: ToolCall) -> dict:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
