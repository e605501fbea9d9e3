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
