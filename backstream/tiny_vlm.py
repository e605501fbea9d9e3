"""The built-in vision-language model: a tiny Qwen2-VL and its processor, shipped with the package.

What `backstream/default_model.py` is for text, this is for images: a run on the `shapes` task
(backstream/rl/data/shapes.py) with `model.name = "default"` must run offline, in minutes on a CPU,
through the code path of a real Hugging Face VLM (`AutoModelForImageTextToText.from_pretrained` on a
folder, M-RoPE, a vision tower, image placeholder tokens). The folder `backstream/assets/vlm/` holds

- the default model's character tokenizer (`build_tokenizer()`) with three more special tokens,
  `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>` (ids 100, 101, 102);
- a Qwen2-VL image processor (the PIL one) that keeps a 56 × 56 picture at 56 × 56: 8 × 8 patches of
  7 px, `image_grid_thw` (1, 8, 8), 16 `<|image_pad|>` tokens after the 2 × 2 merge, one per 14-px cell
  of the shapes grid;
- a chat template (`CHAT_TEMPLATE`) that writes an image part as `<|vision_start|><|image_pad|>
  <|vision_end|>` and a text part as its text; an assistant turn is "=", its text and `<eos>`, and
  the generation prompt is "=": the shapes prompt reads `<|vision_start|><|image_pad|><|vision_end|>
  red?=` and the model answers "2<eos>", as the text model answers "37+45=" with "82<eos>";
- a `Qwen2VLForConditionalGeneration` of 1.02 M parameters (`vlm_config()`: the default model's text
  part with M-RoPE, a 2-block vision tower of width 64), float32, trained by
  `scripts/make_tiny_vlm.py` (1500 steps of 64 rows, 13 min on the 2-core machine) on shapes rows until
  it is right part of the time at temperature 1. On 1024 held-out rows
  (`make_dataset("shapes", 1024, seed=20_000)`): greedy 0.576, sampled at temperature 1 0.488,
  answering "digit<eos>" 1.000 of the time; always answering the most common count (1) is right 0.338
  of the time.

transformers' `Qwen2VLProcessor` cannot be built without torchvision (its video processor), which a
CPU machine may lack: `build_processor()` builds it without the video part. The folder names
"Qwen2VLProcessor" all the same, so that `AutoProcessor` builds the real one where torchvision is
installed (and backstream.rl.data.images.load_processor the same image-only one where it is not).

`build_processor()` and `vlm_config()` are the single definition of both; the script uses them to make
the assets and tests/run/test_tiny_vlm.py checks the shipped files against them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backstream.default_model import SPECIAL_TOKENS, build_tokenizer

TINY_VLM_DIR = Path(__file__).resolve().parent / "assets" / "vlm"

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # ids 100, 101, 102
IMAGE_PIXELS = 56 * 56  # every picture is resized to this many pixels: 56 × 56 stays as it is
PATCH = 7  # the tower's patch: a merged 2 × 2 of patches is one 14-px cell of the shapes grid, one token

# one image part: its placeholder (the processor expands <|image_pad|> to the image's token count)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}={%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}<eos>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}={%- endif -%}"
)


def build_tokenizer_vlm():
    """The default character tokenizer plus the three vision tokens as special tokens (103 ids), with
    the chat template: alone it renders a prompt as the processor does, before the image expansion."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    assert tok.convert_tokens_to_ids(list(VISION_TOKENS)) == [100, 101, 102]
    tok.chat_template = CHAT_TEMPLATE
    return tok


def images_only(cls):
    """`cls` (a processor class with a video part) without its video processor, which torchvision would
    build. It keeps `cls`'s name, so that it saves as `cls` (processor_class) and `AutoProcessor` builds
    the real one where torchvision is installed. Used for every such processor (rl/policy.py
    `load_processor`), not only the tiny VLM's."""
    attrs = [a for a in cls.get_attributes() if a != "video_processor"]

    class ImagesOnly(cls):
        @classmethod
        def get_attributes(klass):
            return attrs

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # with no video token in the vocabulary, "<|video_pad|>" converts to <unk>: an unknown
            # character of the text would be marked as video in mm_token_type_ids
            self.video_token_id = None

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = cls.__name__
    return ImagesOnly


def build_processor():
    """The tiny VLM's processor: `build_tokenizer_vlm()`, a Qwen2-VL PIL image processor at 56 × 56
    pixels and `CHAT_TEMPLATE`, as an image-only `Qwen2VLProcessor`."""
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor  # noqa: PLC0415  (transformers: on use)

    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": IMAGE_PIXELS, "longest_edge": IMAGE_PIXELS},
                                               patch_size=PATCH)
    return images_only(Qwen2VLProcessor)(
        image_processor=image_processor, tokenizer=build_tokenizer_vlm(), video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def vlm_config():
    """The documented architecture: the text part of `default_config()` (hidden 128, 4 layers, 4 query
    and 2 K/V heads of dimension 32, MLP 384, tied embeddings) with M-RoPE sections 4/6/6 of a head's
    16 frequencies (time, height, width), 103 ids; a vision tower of 2 blocks, width 64, 4 heads, 7-px
    patches over 2 frames, whose 2 × 2 merger projects to the text width. There is no video token:
    video_token_id keeps its default, outside the vocabulary, and never matches."""
    from transformers import Qwen2VLConfig  # noqa: PLC0415  (transformers: on use)

    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(SPECIAL_TOKENS) + 96 + len(VISION_TOKENS),
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,  # head_dim = 128 / 4 = 32
            num_key_value_heads=2,
            intermediate_size=384,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            pad_token_id=SPECIAL_TOKENS.index("<pad>"),
            bos_token_id=SPECIAL_TOKENS.index("<bos>"),
            eos_token_id=SPECIAL_TOKENS.index("<eos>"),
        ),
        vision_config=dict(
            depth=2, embed_dim=64, num_heads=4, mlp_ratio=4, hidden_size=128, in_channels=3,
            patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2,
        ),
        vision_start_token_id=100,
        image_token_id=101,
        vision_end_token_id=102,
        tie_word_embeddings=True,
    )


def load_tiny_vlm(dtype: torch.dtype = torch.float32):
    """(model, processor) from the packaged folder, local files only, and `build_processor()` (the
    folder's processor files are the same, tests/run/test_tiny_vlm.py checks it); the model in eval
    mode on the CPU (move it with `.to(device)`)."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415  (transformers: on use)

    if not (TINY_VLM_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the tiny VLM is missing from {TINY_VLM_DIR}: rebuild it with `python scripts/make_tiny_vlm.py`"
        )
    model = AutoModelForImageTextToText.from_pretrained(TINY_VLM_DIR, dtype=dtype, local_files_only=True)
    return model, build_processor()


def save_tiny_vlm(model, processor, out: Path) -> None:
    """A normal HF model folder: weights, config, generation config, the tokenizer, the image
    processor, the chat template and a processor_config.json naming the real processor class."""
    from transformers import GenerationConfig  # noqa: PLC0415  (transformers: on use)

    cfg = model.config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        # as for the default model: "temperature 1" is the model's own distribution, no top-k of 50
        do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(processor.chat_template)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n")


def random_tiny_vlm(out: Path, seed: int = 0) -> Path:
    """The tiny VLM's architecture with random weights, saved to `out` as the shipped folder is (for tests
    that need a VLM folder and not its training)."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415  (transformers: on use)

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(vlm_config(), dtype=torch.float32)
    save_tiny_vlm(model, build_processor(), out)
    return Path(out)
