"""Images in prompts (docs/vision.md): where a row's images come from, the processor that renders them,
and the prompts of a vision-language model as token ids and `Picture`s (stream/vision.py).

A row's prompt is chat messages whose content parts may hold images, in the conventions TRL's users
have:
- `{"type": "image"}` placeholders, filled in order from the row's `images` column (or `image`): file
  paths relative to the data file, PIL images, or `datasets` Image values ({"bytes", "path"});
- inline `{"type": "image", "path": ...}` (or `"image": <PIL image>`) parts;
- OpenAI's `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`; an http(s) URL
  is refused, the run fetches nothing from the network.

The model folder's processor renders the chat template and expands each image into its placeholder
tokens; each image is also processed alone, which gives the inputs the vision tower takes for it and
the number of placeholder tokens it fills. Every row is read when the run is built, so a missing or
corrupt image, a placeholder without an image, an image without a placeholder and a prompt over
`data.max_prompt_tokens` stop the run before its folder, naming the row.

The processor is loaded with the model (rl/policy.py `load_processor`).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os

import torch

from backstream.checks import UserError
from backstream.rl.policy import tokenizer_of
from backstream.stream.vision import Picture

IMAGE_COLUMNS = ("images", "image")


def has_images(example: dict) -> bool:
    """Whether a row holds an image: an image column, or an image part in its prompt."""
    if any(_column(example, c) for c in IMAGE_COLUMNS):
        return True
    prompt = example.get("prompt")
    return isinstance(prompt, list) and any(_is_image(part) for m in prompt if isinstance(m, dict)
                                            for part in _parts(m.get("content")))


def _column(example: dict, name: str) -> list:
    v = example.get(name)
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _parts(content) -> list:
    return content if isinstance(content, list) else []


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def open_image(src, where: str, base_dir: str):
    """An RGB PIL image from a path (relative to `base_dir`), bytes, a PIL image or a `datasets` Image
    value; a missing or unreadable one is an error naming `where` and the file."""
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    name = "the image"
    try:
        if isinstance(src, Image.Image):
            img = src
        elif isinstance(src, dict) and (src.get("bytes") or src.get("path")):
            if src.get("bytes"):
                img = Image.open(io.BytesIO(src["bytes"]))
            else:
                return open_image(src["path"], where, base_dir)
        elif isinstance(src, (bytes, bytearray)):
            img = Image.open(io.BytesIO(src))
        elif isinstance(src, str):
            name = src
            path = src if os.path.isabs(src) else os.path.join(base_dir, src)
            if not os.path.exists(path):
                raise UserError(f"data: {where}: image file {path} does not exist (a relative path is read from the "
                                "data file's folder)")
            img = Image.open(path)
        else:
            raise UserError(f"data: {where}: an image must be a file path, bytes or a PIL image, got "
                            f"{type(src).__name__}")
        img.load()  # decode now: a truncated file fails here, not in the middle of a run
    except UserError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UserError(f"data: {where}: {name} is not a readable image ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


def _data_url(url: str, where: str):
    if url.startswith(("http://", "https://")):
        raise UserError(f"data: {where}: image_url {url[:60]!r} is on the network, and a run fetches nothing; "
                        "give the image as a data URL (data:image/png;base64,...) or a file path")
    if not url.startswith("data:") or ";base64," not in url:
        raise UserError(f"data: {where}: image_url must be a data URL (data:image/png;base64,...), got {url[:40]!r}")
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except ValueError as e:
        raise UserError(f"data: {where}: image_url's base64 does not decode ({e})") from None


def row_images(example: dict, row: int, base_dir: str) -> tuple[list, list]:
    """(the prompt's messages with every image part a bare `{"type": "image"}` placeholder, the images
    in order), read from the row's parts and its image column; a count that does not match is an error."""
    prompt = example.get("prompt")
    column = next((_column(example, c) for c in IMAGE_COLUMNS if _column(example, c)), [])
    col_name = next((c for c in IMAGE_COLUMNS if _column(example, c)), "images")
    if not isinstance(prompt, list):
        if column:
            raise UserError(f"data: example {row} has {len(column)} image(s) in its `{col_name}` column but a text "
                            "prompt; give its prompt as chat messages with a {\"type\": \"image\"} part per image")
        return prompt, []
    taken, images, messages = 0, [], []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            messages.append(m)
            continue
        parts = []
        for part in content:
            if not _is_image(part):
                parts.append(part)
                continue
            where = f"example {row}, image {len(images) + 1}"
            if part["type"] == "image_url":
                url = part.get("image_url")
                src = _data_url(url.get("url", "") if isinstance(url, dict) else str(url), where)
            elif part.get("path") is not None or part.get("image") is not None:
                src = part.get("path") if part.get("path") is not None else part["image"]
            else:
                if taken == len(column):
                    raise UserError(f"data: example {row}: its prompt has more image placeholders than its "
                                    f"`{col_name}` column has images ({len(column)}); give one image per "
                                    "{\"type\": \"image\"} part")
                src, taken = column[taken], taken + 1
            images.append(open_image(src, where, base_dir))
            parts.append({"type": "image"})
        messages.append({**m, "content": parts})
    if taken < len(column):
        raise UserError(f"data: example {row}: its `{col_name}` column has {len(column)} images but its prompt only "
                        f"{taken} {{\"type\": \"image\"}} placeholder(s); give each image a placeholder")
    return messages, images


class Pictures:
    """A processor's images: each one processed alone (the tower's inputs for it, its placeholder
    count), the same image once (by its pixels' digest)."""

    def __init__(self, processor, image_token_id: int, config=None):
        """`config`: the model's, whose vision start and end tokens frame an image in `marker`."""
        self.processor, self.image_token_id, self.config = processor, image_token_id, config
        self.token = getattr(processor, "image_token", None)
        if self.token is None:
            self.token = tokenizer_of(processor).convert_ids_to_tokens(image_token_id)
        self._tokens: dict = {}  # image size -> (its placeholder count, the ids its image token expands into)

    def picture(self, img) -> Picture:
        """`img` (a PIL image) as the processor makes it alone; it keeps the image and its expansion,
        for a server that runs the processor itself (rl/backends/vllm/requests.py)."""
        out = self.processor.image_processor(images=[img], return_tensors="pt")
        inputs = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        h = hashlib.sha256()
        for k in sorted(inputs):
            h.update(k.encode())
            h.update(inputs[k].contiguous().numpy().tobytes())
        if img.size not in self._tokens:  # its placeholders, as the processor expands one image alone
            ids = self.processor(text=[self.token], images=[img], add_special_tokens=False)["input_ids"][0]
            self._tokens[img.size] = (sum(t == self.image_token_id for t in ids), tuple(int(t) for t in ids))
        count, span = self._tokens[img.size]
        return Picture(h.hexdigest(), inputs, count, source=img, token=self.image_token_id, span=span)

    def from_url(self, url: str, where: str) -> Picture:
        """An `image_url` part's image (a data URL only: a run fetches nothing) as `picture` makes it;
        anything else is an error naming `where`."""
        return self.picture(open_image(_data_url(url, where), where, "."))

    def expand(self, ids: list[int], pictures: list[Picture], where: str) -> tuple[list[int], list[bool]]:
        """`ids` as a template renders them (one image token per image, in order) with each image token
        repeated over its picture's placeholders, as the processor expands it; and which of the
        results are images. A count that does not match, or a family whose processor expands an image
        into more than repeated image tokens (rows and columns of tiles: Idefics3's), is an error
        naming `where`."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(pictures):
            raise UserError(f"{where}: the template rendered {len(at)} image token(s) for {len(pictures)} image(s); "
                            "it must render an image part (or the plain format's image) as the image token once "
                            "(a chat template that renders no image parts in that role drops them)")
        if pictures and not self._repeats():
            raise UserError(f"{where}: {type(self.processor).__name__} expands an image into more than its image "
                            "token repeated, which images inside an episode do not follow yet (a prompt's images "
                            "do); use a family whose processor repeats it (Qwen-VL, LLaVA, ...)")
        out, mask, pics = [], [], iter(pictures)
        for t in ids:
            n = next(pics).tokens if t == self.image_token_id else 1
            out += [t] * n
            mask += [t == self.image_token_id] * n
        return out, mask

    def _repeats(self) -> bool:
        """Whether the processor expands its image token into nothing but that token repeated."""
        if not hasattr(self, "_repeat"):
            from PIL import Image  # noqa: PLC0415

            img = Image.new("RGB", (64, 64))
            tok = tokenizer_of(self.processor)
            base = tok(self.token, add_special_tokens=True)["input_ids"]
            got = self.processor(text=[self.token], images=[img], return_tensors="pt")["input_ids"][0].tolist()
            n = got.count(self.image_token_id)
            want = [x for t in base for x in ([t] * n if t == self.image_token_id else [t])]
            self._repeat = got == want
        return self._repeat

    def marker(self) -> str:
        """The text of one image as a format without a template writes it: the image token, between
        the family's vision start and end tokens where it has them."""
        tok = tokenizer_of(self.processor)
        around = [getattr(self.config, k, None) for k in ("vision_start_token_id", "vision_end_token_id")]
        start, end = (tok.convert_ids_to_tokens(int(t)) if isinstance(t, int) else "" for t in around)
        return f"{start}{self.token}{end}"


def placeholders_only(messages: list) -> list:
    """Chat messages with every image part (inline, path, data URL) a bare `{"type": "image"}`, as a
    template renders one; the images themselves come from `row_images`."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image"} if _is_image(p) else p for p in content]}
        out.append(m)
    return out


def encode_visual(examples: list[dict], processor, image_token_id: int, max_tokens: int, base_dir: str = "."):
    """(token ids, rendered text, pictures) of every row's prompt through `processor`: its chat template,
    each image expanded into its placeholder tokens; a prompt over `max_tokens` is an error (images
    included: they are never cut)."""
    pictures = Pictures(processor, image_token_id)
    ids_out, text_out, pics_out = [], [], []
    for i, ex in enumerate(examples):
        messages, images = row_images(ex, i, base_dir)
        if isinstance(messages, list):
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = messages
        out = processor(text=[text], images=images or None, return_tensors="pt")
        ids = out["input_ids"][0].long()
        pics = [pictures.picture(img) for img in images]
        want, have = sum(p.tokens for p in pics), int((ids == image_token_id).sum())
        if have != want:
            raise UserError(f"data: example {i}: its rendered prompt holds {have} image placeholder tokens, but its "
                            f"{len(pics)} image(s) fill {want}; the chat template or the text adds or drops "
                            "placeholders (write images as {\"type\": \"image\"} parts, not as their token)")
        if len(ids) > max_tokens:
            raise UserError(f"data: prompt {i} has {len(ids)} tokens ({want} of them its {len(pics)} image(s)), more "
                            f"than data.max_prompt_tokens={max_tokens} (raise it, or use smaller images; prompts are "
                            "never truncated)")
        ids_out.append(ids)
        text_out.append(text)
        pics_out.append(pics)
    return ids_out, text_out, pics_out
