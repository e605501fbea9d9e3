"""The built-in default model: a tiny Qwen3 and a character-level tokenizer shipped with the package.

`backstream demo` must run anywhere, offline, in minutes on a CPU, and still go through exactly the
code path of a real Hugging Face model: `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.
from_pretrained` on a folder. So the folder `backstream/assets/default/` holds what `save_pretrained`
writes for

- a `tokenizers` WordLevel tokenizer with one token per character (digits, ASCII letters, ASCII
  punctuation, space, newline) and the special tokens `<pad>`, `<bos>`, `<eos>`, `<unk>`, wrapped
  in a `PreTrainedTokenizerFast`. No BOS is added to encoded text and there is no chat template:
  prompts are plain text, and a completion ends with `<eos>`;
- a `Qwen3ForCausalLM` of about 0.8 M parameters (`default_config()`), stored in float32,
  trained by `scripts/make_default_model.py` on the tasks of `backstream/rl/data/tasks.py` just far
  enough that it answers in the right format (digits, then `<eos>`) but is right only part of the
  time at temperature 1, so that RL has something to improve.

`build_tokenizer()` and `default_config()` are the single definition of both; the script uses them
to make the assets and the tests check the shipped files against them.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default"

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: 4 special tokens then 96 characters (100 ids).
    A character outside `CHARS` (a tab, a non-ASCII letter) becomes `<unk>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415  (transformers: on use)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # every character is its own "word"; [\s\S] because '.' would skip the newline
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # WordLevel's default decoding joins tokens with spaces; Fuse concatenates them as they are
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a."
        model_max_length=4096,
    )


def default_config(vocab_size: int = len(SPECIAL_TOKENS) + len(CHARS)):
    """The documented architecture: Qwen3, hidden 128, 4 layers, 4 query heads and 2 K/V heads
    (GQA) of dimension 32, MLP 384, tied embeddings, 4096 positions (kvlookup prompts are ~1.1K)."""
    from transformers import Qwen3Config  # noqa: PLC0415  (transformers: on use)

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        bos_token_id=SPECIAL_TOKENS.index("<bos>"),
        eos_token_id=SPECIAL_TOKENS.index("<eos>"),
    )


def load_default(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from the packaged folder, local files only. The model is in eval mode
    (as `from_pretrained` returns it) on the CPU; move it with `.to(device)`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415  (transformers: on use)

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {DEFAULT_MODEL_DIR}: "
            "rebuild it with `python scripts/make_default_model.py`"
        )
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=dtype, local_files_only=True)
    return model, tokenizer
