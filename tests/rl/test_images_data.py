"""Images in a run's data (backstream/rl/data/images.py, rl/policy.py load_processor): the conventions a
row may write its images in read to the same prompt; each image processed alone matches what the
processor expands it into; a processor that wants torchvision for its video part is built without it;
and bad input (a missing, corrupt or network image, a placeholder without an image, an image without
a placeholder, a prompt over data.max_prompt_tokens) is an error naming the row."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from backstream.checks import UserError
from backstream.rl.data.images import encode_visual, has_images, row_images
from backstream.rl.policy import load_processor
from backstream.tiny_vlm import build_processor

IMAGE_ID = 101


def picture(seed: int = 0, size=(56, 56)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(*size[::-1], 3, generator=g) * 255).to(torch.uint8).numpy())


def ask(*parts):
    return [{"role": "user", "content": list(parts)}]


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def test_every_convention_reads_the_same_prompt(tmp_path, processor):
    img = picture(1)
    img.save(tmp_path / "a.png")
    text = {"type": "text", "text": "red?"}
    rows = [
        {"prompt": ask({"type": "image"}, text), "images": ["a.png"]},  # a path relative to the data file
        {"prompt": ask({"type": "image"}, text), "image": img},  # a PIL image, the `image` column
        {"prompt": ask({"type": "image", "path": str(tmp_path / "a.png")}, text)},
        {"prompt": ask({"type": "image_url", "image_url": {"url": data_url(img)}}, text)},
        {"prompt": ask({"type": "image"}, text),
         "images": [{"bytes": (tmp_path / "a.png").read_bytes(), "path": None}]},
    ]
    assert all(has_images(r) for r in rows) and not has_images({"prompt": "1+1="})
    ids, texts, pics = encode_visual(rows, processor, IMAGE_ID, 4096, str(tmp_path))
    for i in range(1, len(rows)):
        assert torch.equal(ids[i], ids[0]) and texts[i] == texts[0]
        assert pics[i][0].digest == pics[0][0].digest
    assert pics[0][0].tokens == int((ids[0] == IMAGE_ID).sum()) == 16  # 56 x 56: 8 x 8 patches, merged 2 x 2
    # an image processed alone is what the processor gave the whole prompt
    whole = processor(text=texts[:1], images=[img], return_tensors="pt")
    assert torch.equal(whole["pixel_values"], pics[0][0].inputs["pixel_values"])
    other = encode_visual([{"prompt": ask({"type": "image"}, text), "images": [picture(2)]}], processor, IMAGE_ID,
                          4096)[2]
    assert other[0][0].digest != pics[0][0].digest


def test_two_images_in_order(processor):
    a, b = picture(1), picture(2)
    msgs, imgs = row_images({"prompt": ask({"type": "image"}, {"type": "text", "text": "x"}, {"type": "image"}),
                             "images": [a, b]}, 0, ".")
    assert [m["content"] for m in msgs] == [[{"type": "image"}, {"type": "text", "text": "x"}, {"type": "image"}]]
    assert [i.tobytes() for i in imgs] == [a.tobytes(), b.tobytes()]


@pytest.mark.parametrize("row, message", [
    ({"prompt": ask({"type": "image"}), "images": ["missing.png"]}, r"^data: example 0, image 1: image file .*missing"
                                                                    r"\.png does not exist"),
    ({"prompt": ask({"type": "image"}), "images": ["bad.png"]},
     r"^data: example 0, image 1: bad.png is not a readable"),
    ({"prompt": ask({"type": "image"}, {"type": "image"}), "images": ["ok.png"]},
     r"^data: example 0: its prompt has more image placeholders than its `images` column has images \(1\)"),
    ({"prompt": ask({"type": "text", "text": "hi"}), "images": ["ok.png"]},
     r"^data: example 0: its `images` column has 1 images but its prompt only 0"),
    ({"prompt": "hi", "images": ["ok.png"]}, r"^data: example 0 has 1 image\(s\) in its `images` column but a text"),
    ({"prompt": ask({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})},
     r"^data: example 0, image 1: image_url 'https://example.com/a.png' is on the network"),
])
def test_bad_images_are_refused_naming_the_row(tmp_path, processor, row, message):
    picture().save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(UserError, match=message):
        encode_visual([row], processor, IMAGE_ID, 4096, str(tmp_path))


def test_a_prompt_over_the_limit_names_its_images(processor):
    row = {"prompt": ask({"type": "image"}, {"type": "text", "text": "red?"}), "images": [picture(0, (112, 112))]}
    with pytest.raises(UserError, match=r"^data: prompt 0 has \d+ tokens \(\d+ of them its 1 image\(s\)\), more than "
                                        r"data.max_prompt_tokens=8"):
        encode_visual([row], processor, IMAGE_ID, 8)


def test_a_processor_that_wants_torchvision_is_built_without_its_video_part(tmp_path, processor):
    """The folder names Qwen2VLProcessor, whose video processor needs torchvision (not installable
    beside the CPU torch): load_processor builds the same class from its image processor (PIL) and
    tokenizer, and it renders as the one built in memory."""
    processor.tokenizer.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(processor.chat_template)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed: AutoProcessor builds the whole processor")
    except ImportError:
        pass
    loaded = load_processor(str(tmp_path))
    assert isinstance(loaded, type(processor).__mro__[1]) and not hasattr(loaded, "video_processor")
    assert type(loaded.image_processor).__name__.endswith("Pil")
    row = {"prompt": ask({"type": "image"}, {"type": "text", "text": "red?"}), "images": [picture(3)]}
    a, b = encode_visual([row], loaded, IMAGE_ID, 4096), encode_visual([row], processor, IMAGE_ID, 4096)
    assert torch.equal(a[0][0], b[0][0]) and a[1] == b[1] and a[2][0][0].digest == b[2][0][0].digest
