"""Prompt data: JSONL files, `datasets` folders, or a built-in generated task.

Every example is a dict with a `prompt` column (plain text, or chat messages — a list of
{"role", "content"} — rendered with the tokenizer's chat template) and any other columns, which
reward functions receive as keyword arguments, as in TRL.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import torch

from backstream.checks import UserError, at_least, literals
from backstream.rl.data.tasks import TASKS, make_dataset, plain_shot, solved_examples


@dataclass(kw_only=True)
class DataConfig:
    task: Literal[tuple(TASKS)] = "arith"
    """Built-in generated task (backstream/rl/data/tasks.py), used when `path` is empty."""
    format: Literal["auto", "chat", "plain"] = "auto"
    """How a built-in task's prompts reach the model: "chat" = one user message that asks the question in
    words and the answer's form, through the tokenizer's chat template, scored by the "answer" reward
    (the answer read from the response: its "Answer:" line, \\boxed{} or last number); "plain" = the
    bare text the built-in default model continues ("37+45="), scored by "exact_match"; "auto" = chat
    when the tokenizer has a chat template. (A reward.functions of your own is kept. A data.path
    file's prompts are used as they are: text, or chat messages.)"""
    shots: int | None = None
    """Solved examples of the task before each built-in prompt ("12+34=46\n" lines, or user/assistant turns
    in the chat format), drawn from the task's generator, none the row itself, the same for every sample
    of a group (part of the prompt the group shares). Unset = 0, but 3 under data.format = "auto" for a
    base model (no chat template, not the shipped default), which cannot hit the answer's format
    without seeing it; the run folder's config.toml states the number."""
    path: str = ""
    """A JSONL file or a `datasets` folder with a `prompt` column (text or chat messages)."""
    num_examples: int = 2048
    """Examples generated for a built-in task."""
    max_prompt_tokens: int = 4096
    """Prompts longer than this are an error (no silent truncation)."""

    def __post_init__(self):
        literals(self, "data")
        at_least("data.num_examples", self.num_examples, 1)
        at_least("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        if self.shots is not None:
            at_least("data.shots", self.shots, 0)
            check_shots(self.task, self.shots, "data.shots", self.path)

    def holds_images(self) -> bool:
        """Whether the prompts hold images (a built-in visual task, or a data.path row with an image),
        which makes the run a vision-language model's (rl/data/images.py)."""
        if not self.path:
            return TASKS[self.task].images
        from backstream.rl.data.images import has_images  # noqa: PLC0415

        return any(has_images(e) for e in self._loaded())

    def _loaded(self) -> list[dict]:
        if getattr(self, "_rows", None) is None:
            object.__setattr__(self, "_rows", load_examples(self.path))
        return self._rows

    def folder(self) -> str:
        """Where a row's relative image paths are read from: data.path's folder (the file's, or the
        `datasets` folder itself)."""
        if not self.path:
            return "."
        return self.path if os.path.isdir(self.path) else os.path.dirname(os.path.abspath(self.path))

    def resolved_format(self, tokenizer) -> str:
        """"chat" or "plain" for a built-in task: `format`, "auto" decided by the tokenizer."""
        if self.format == "chat" and getattr(tokenizer, "chat_template", None) is None:
            raise UserError("data.format = \"chat\": the tokenizer has no chat template; set data.format = \"plain\" "
                             "(or \"auto\"), or use a tokenizer with one")
        if self.format != "auto":
            return self.format
        return "chat" if getattr(tokenizer, "chat_template", None) is not None else "plain"

    def build(self, seed: int, prompt_optional: bool = False) -> list[dict]:
        """The examples: read from `path`, else `num_examples` rows of the built-in `task` drawn with
        `seed` (as chat messages when `format` is "chat": `resolved_format` first); checked (not empty,
        every one with a `prompt` unless `prompt_optional`: an environment whose reset returns the
        task's text owns its data)."""
        if self.path:
            examples, source = self._loaded(), self.path
        else:
            rows, source = make_dataset(self.task, self.num_examples, seed), f"task {self.task}"
            examples = self.present(rows, seed, self.shots or 0)
        check_examples(examples, source, prompt_optional)
        return examples

    def present(self, rows: list[dict], seed: int, shots: int) -> list[dict]:
        """Rows of the built-in task as the model reads them: `shots` solved examples first (drawn with
        `seed` and the row's index), in `format` (plain text, or chat messages when "chat")."""
        task = TASKS[self.task]
        if task.images:  # its rows are chat messages with their images already (rl/data/shapes.py)
            return rows
        out = []
        for i, row in enumerate(rows):
            solved = solved_examples(task, row, shots, seed, i) if shots else []
            if self.format == "chat":
                turns = [m for s in solved for m in ({"role": "user", "content": task.chat(s)},
                                                     {"role": "assistant", "content": s["answer"]})]
                out.append({**row, "prompt": [*turns, {"role": "user", "content": task.chat(row)}]})
            else:
                out.append({**row, "prompt": "".join(map(plain_shot, solved)) + row["prompt"]})
        return out


def check_shots(task: str, shots: int, key: str, path: str = "") -> None:
    """`shots` solved examples are something `task` can show (a built-in task's rows, not data.path's)."""
    if not shots:
        return
    if path:
        raise UserError(f"{key} = {shots}: solved examples are drawn from a built-in task, and the run reads "
                         f"data.path ({path}); put them in your prompts, or set {key} = 0")
    if not TASKS[task].shots:
        what = ("a conversation with pictures" if TASKS[task].images else "a whole episode with tool calls")
        raise UserError(f"{key} = {shots}: task {task}'s solved example would be {what}, "
                         f"which is not built in; set {key} = 0")


def load_examples(path: str) -> list[dict]:
    """Read a JSONL file or a folder saved by `datasets` (`save_to_disk`)."""
    if os.path.isdir(path):
        try:
            import datasets  # noqa: PLC0415
        except ImportError:
            raise UserError(f"data.path: {path} is a folder; reading a `datasets` folder needs "
                             "`pip install datasets`") from None
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [dict(x) for x in ds]
    if not os.path.exists(path):
        raise UserError(f"data.path: {path} does not exist")
    examples = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    examples.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"data.path: {path} line {n} is not valid JSON ({e.msg})") from None
    return examples


def check_examples(examples: list[dict], source: str, prompt_optional: bool = False) -> None:
    if not examples:
        raise UserError(f"data: {source} holds no examples")
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict) or ("prompt" not in ex and not prompt_optional):
            cols = sorted(ex) if isinstance(ex, dict) else type(ex).__name__
            raise UserError(f"data: example {i} of {source} has no `prompt` column (columns: {cols})")


def render_prompt(prompt, tokenizer, row: int | None = None) -> str:
    """Text as is; chat messages through the tokenizer's chat template. `row`: the example's index, for
    the error messages."""
    where = "" if row is None else f" (example {row})"
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and not prompt:
        raise UserError(f"data: the prompt{where} is an empty list of chat messages; give it at least one "
                         "{\"role\": \"user\", \"content\": ...} message")
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError("data: the prompt is a list of chat messages but the tokenizer has no chat_template")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    raise UserError(f"data: a prompt must be text or a list of chat messages, got {type(prompt).__name__}")


def encode_prompts(examples: list[dict], tokenizer, max_tokens: int) -> list[torch.Tensor]:
    """Token ids of every prompt; a prompt longer than `max_tokens` is an error, never truncated. A
    row without a prompt (its environment's reset gives the text) has no ids."""
    out = []
    for i, ex in enumerate(examples):
        if "prompt" not in ex:
            out.append(torch.zeros(0, dtype=torch.long))
            continue
        ids = tokenizer(render_prompt(ex["prompt"], tokenizer, i), add_special_tokens=True)["input_ids"]
        if len(ids) > max_tokens:
            raise UserError(
                f"data: prompt {i} has {len(ids)} tokens, more than data.max_prompt_tokens={max_tokens} "
                "(raise it, or shorten the prompt; prompts are never truncated)"
            )
        if not ids:
            raise UserError(f"data: prompt {i} (example {i}) is empty after tokenization; give it some text")
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def encode_and_render(examples: list[dict], tokenizer, max_tokens: int, max_new_tokens: int, context: int | None,
                      processor=None, folder: str = ".", image_token_id: int | None = None
                      ) -> tuple[list[torch.Tensor], list[str], list[list] | None]:
    """Every prompt's token ids, text and images (a row without a prompt: none, its environment's reset
    gives it); `processor`: a vision-language model's, which renders rows with images (their files read
    from `folder`, `image_token_id` the model's placeholder; rl/data/images.py), else the images are
    None; a prompt whose completion could run
    past the model's `context` is an error."""
    pictures = None
    if processor is not None:
        from backstream.rl.data.images import encode_visual  # noqa: PLC0415

        prompts, text, pictures = encode_visual(examples, processor, image_token_id, max_tokens, folder)
    else:
        prompts = encode_prompts(examples, tokenizer, max_tokens)
        text = [render_prompt(e["prompt"], tokenizer, i) if "prompt" in e else "" for i, e in enumerate(examples)]
    longest = max(len(p) for p in prompts)
    if context is not None and longest + max_new_tokens > context:
        raise UserError(f"data: the longest prompt ({longest} tokens) + rollout.max_new_tokens "
                         f"({max_new_tokens}) exceeds the model's context ({context} positions)")
    return prompts, text, pictures


class PromptStream:
    """Shuffled epochs over the examples, seeded; `position` is saved in checkpoints."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.position = n, seed, 0
        self._cached: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._cached = (epoch, torch.randperm(self.n, generator=g).tolist())
        return self._cached[1]

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, self.n)
            out.append(self._order(epoch)[i])
            self.position += 1
        return out
