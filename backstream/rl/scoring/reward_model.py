"""A sequence-classification model as a reward function (the spec `reward_model:<folder>`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backstream.checks import UserError


class RewardModel:
    """Scores `prompt + completion` with a sequence-classification model: the logit of label 0.

    The text is the plain concatenation (of the message contents for chat data); apply the reward
    model's chat template to the prompts beforehand if it was trained on one. Sequences are
    right-padded, whatever the tokenizer's setting: positions then stay those of the unpadded text
    (left padding shifts them, which RoPE forgives but absolute position embeddings do not), so a
    batch scores like one sample at a time.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8):
        if batch_size < 1:
            raise UserError(f"RewardModel batch_size={batch_size}: must be at least 1")
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise UserError("RewardModel: the tokenizer has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        config = model.config.get_text_config()
        # HF pools the rightmost token that is not the model's pad id: padding must use that id
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        self.pad_id = config.pad_token_id
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        source = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.__name__ = f"reward_model:{source}"

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, batch_size: int = 8) -> RewardModel:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: PLC0415

        model = AutoModelForSequenceClassification.from_pretrained(folder)
        return cls(model, AutoTokenizer.from_pretrained(folder), batch_size=batch_size)

    @torch.no_grad()
    def __call__(
        self, completions: list[str], prompts: list[str] | None = None, **kwargs: Any
    ) -> list[float]:
        prompts = prompts if prompts is not None else [""] * len(completions)
        joined = lambda x: x if isinstance(x, str) else "".join(str(m.get("content", "")) for m in x)  # noqa: E731
        texts = [joined(p) + joined(c) for p, c in zip(prompts, completions, strict=True)]
        device = next(self.model.parameters()).device
        # similar lengths in one batch waste less compute on padding
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        scores = [0.0] * len(texts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            batch = self.tokenizer(
                [texts[i] for i in idx], padding=True, padding_side="right", return_tensors="pt"
            )
            batch["input_ids"][batch["attention_mask"] == 0] = self.pad_id
            logits = self.model(**batch.to(device)).logits  # [B, num_labels]
            for i, score in zip(idx, logits[:, 0].float().tolist()):
                scores[i] = score
        return scores
