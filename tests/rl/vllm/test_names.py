"""The served checkpoint's names of the policy's tensors (rl/backends/vllm/weights/names.py), read off
the names and shapes alone: a text class against its composite (transformers 5's layout and the older
one), the reverse refused, and what is ambiguous or unmatched refused with the names; and how a run
takes the map (rl/backends/vllm/backend.py `served_names`): one class on every server, by transfer."""

import pytest

from backstream.checks import UserError
from backstream.config import VLLMConfig
from backstream.rl.backends.vllm.backend import served_names
from backstream.rl.backends.vllm.serve import Needs
from backstream.rl.backends.vllm.weights.names import NameMapError, name_map

H, V = 8, 32
TEXT = {"model.embed_tokens.weight": (V, H), "model.layers.0.self_attn.q_proj.weight": (H, H),
        "model.layers.0.mlp.down_proj.weight": (H, 2 * H), "model.layers.1.self_attn.q_proj.weight": (H, H),
        "model.norm.weight": (H,), "lm_head.weight": (V, H)}
VISION = {"model.vision_model.encoder.layers.0.self_attn.q_proj.weight": (H, H),  # the text layers' shape
          "model.vision_model.post_layernorm.weight": (H,),
          "model.connector.modality_projection.proj.weight": (H, 4 * H)}


def _composite(text_head="model.text_model.", head_head=""):
    served = {(head_head + n if n.startswith("lm_head") else text_head + n.removeprefix("model.")): s
              for n, s in TEXT.items()}
    return {**served, **VISION}


def test_a_text_class_maps_onto_its_composite_and_the_rest_stays_as_served():
    rename, keep = name_map(TEXT, _composite())
    assert rename == {n: ("model.text_model." + n.removeprefix("model.") if n.startswith("model.") else n)
                      for n in TEXT}
    assert keep == sorted(VISION)  # the vision q_proj has a text layer's shape and name tail, and is not taken


def test_the_older_layout_language_model_dot_model():
    rename, keep = name_map(TEXT, _composite("language_model.model.", "language_model."))
    assert rename["model.layers.1.self_attn.q_proj.weight"] == "language_model.model.layers.1.self_attn.q_proj.weight"
    assert rename["lm_head.weight"] == "language_model.lm_head.weight" and keep == sorted(VISION)


def test_the_composite_against_its_text_class_is_refused_with_the_vision_tensors():
    composite = _composite()
    with pytest.raises(NameMapError, match=r"3 of the policy's 9 tensors .*model.connector"):
        name_map(composite, TEXT)


def test_a_shape_that_differs_is_no_counterpart():
    served = {**_composite(), "model.text_model.norm.weight": (H + 1,)}
    with pytest.raises(NameMapError, match=r"1 of the policy's 6 tensors .*'model.norm.weight'"):
        name_map(TEXT, served)


def test_two_equally_good_counterparts_are_refused():
    served = {("a." + n): s for n, s in TEXT.items()} | {("b." + n): s for n, s in TEXT.items()}
    with pytest.raises(NameMapError, match=r"6 of the policy's 6 tensors have no one counterpart"):
        name_map(TEXT, served)


def _infos(*renames, arch="Idefics3ForConditionalGeneration"):
    return [{"architecture": arch, "rename": r, "keep": ["model.connector.x.weight"]} for r in renames]


def test_a_run_takes_the_map_by_transfer_only_and_from_one_class():
    v, needs = VLLMConfig(), Needs(architecture="LlamaForCausalLM")
    rename, _ = name_map(TEXT, _composite())
    assert served_names(v, [{"architecture": "LlamaForCausalLM"}], "transfer", needs) is None
    assert served_names(v, _infos(rename, rename), "transfer", needs) == rename
    with pytest.raises(UserError, match=r"vllm.weights: .* a publish by disk cannot rename them"):
        served_names(v, _infos(rename), "disk", needs)
    with pytest.raises(UserError, match=r"vllm.urls: the servers serve .* serve one class on all of them"):
        served_names(v, [*_infos(rename), {"architecture": "LlamaForCausalLM"}], "transfer", needs)
