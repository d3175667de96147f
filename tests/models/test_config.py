"""LinmemConfig: every bad field or section key is a ValueError naming it and its valid range, typos get a
"did you mean", the keywords transformers passes are accepted, save -> load round-trips, and each mixer
takes its own arguments from the config (``mixer.window`` reaches every attention mixer, FoX included)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from linmem.layers import mixer_class, mixer_names
from linmem.layers.moe import MoEArgs
from linmem.models import LinmemConfig
from linmem.models.config import FLAT_FIELDS, MODEL_SET_ARGS, SECTIONS, pretrained_config_keys, section_fields

SMALL = dict(vocab_size=64, hidden_size=32, num_heads=2, layer_pattern="LN")


@pytest.mark.parametrize("fields,message", [
    (dict(num_heads=0), r"`num_heads` must be an integer >= 1, got 0"),
    (dict(hidden_size=-8), r"`hidden_size` must be an integer >= 1, got -8"),
    (dict(hidden_size="32"), r"`hidden_size` must be an integer >= 1, got '32'"),
    (dict(vocab_size=0), r"`vocab_size` must be an integer >= 1"),
    (dict(mixer={"conv_size": 0}), r"`mixer.conv_size` must be an integer >= 1"),
    (dict(mixer={"head_dim": 0}), r"`mixer.head_dim` must be an integer >= 1 or None"),
    (dict(mixer={"expand_v": 0}), r"`mixer.expand_v` must be a finite number > 0"),
    (dict(mixer={"expand_v": 0.3}), r"`mixer.expand_v` = 16 \* 0.3 must be a whole number"),
    (dict(rms_norm_eps=-1e-6), r"`rms_norm_eps` must be a finite number > 0"),
    (dict(rms_norm_eps=float("nan")), r"`rms_norm_eps` must be a finite number > 0"),
    (dict(mixer={"window": 0}), r"LinmemConfig: `mixer.window` must be an integer >= 1 or None"),
    (dict(mixer={"window": 2.5}), r"`mixer.window` must be an integer >= 1 or None"),
    (dict(mixer={"qk_norm": "yes"}), r"`mixer.qk_norm` must be True or False"),
    (dict(initializer_range=-0.1), r"`initializer_range` must be a finite number >= 0"),
    (dict(mixer={"num_kv_heads": 3}), r"`num_heads` = 2 must be a multiple of `mixer.num_kv_heads` = 3"),
    (dict(hidden_size=30, num_heads=4), r"`hidden_size` = 30 is not divisible by `num_heads` = 4; set `mixer.head"),
    (dict(eos_token_id=64), r"`eos_token_id` must be None or a token id in \[0, vocab_size = 64\)"),
    (dict(attention="swa"), r"swa: `mixer.window` must be set"),
    (dict(mixer={"forget_gate": "fixed"}), r"softmax: has no forget gate"),
    (dict(attention="fox", mixer={"forget_gate": "learnt"}), r"unknown `mixer.forget_gate` 'learnt'; valid: data_dep"),
    (dict(memory="linear_attention", mixer={"feature_map": "cosine"}), r"unknown `mixer.feature_map` 'cosine'; valid"),
    (dict(memory="mom", mom={"memory": "rwkv7"}), r"LinmemConfig: unknown `mom.memory` 'rwkv7'; valid: .*kda"),
    (dict(mom={"num_memories": 0}), r"LinmemConfig: `mom.num_memories` must be an integer >= 1, got 0"),
    (dict(mom={"num_memories": 2, "top_k": 3}), r"`mom.top_k` = 3 must lie in \[1, num_memories = 2\]"),
    (dict(liger={"window": 0}), r"LinmemConfig: `liger.window` must be an integer >= 1, got 0"),
    (dict(memory="liger", mixer={"head_dim": 6}, liger={"memory": "gsa", "num_slots": 4}),
     r"liger: the key is pooled to `liger.num_slots` = 4 values per head, which must divide the head dim 6"),
    (dict(gsa={"num_slots": 0}), r"`gsa.num_slots` must be an integer >= 1 or None"),
    (dict(llama_attention={"qkv_bias": 1}), r"`llama_attention.qkv_bias` must be True or False"),
    (dict(moe={"router": "relu"}), r"unknown `moe.router` 'relu'; valid: softmax, sigmoid"),
    (dict(moe={"intermediate_size": 0}), r"`moe.intermediate_size` must be an integer >= 1, got 0"),
    (dict(mixer=[("window", 4)]), r"`mixer` must be a dict of mixer options \(or None\)"),
])
def test_bad_fields_are_refused_with_their_name_and_range(fields, message):
    with pytest.raises(ValueError, match=message):
        LinmemConfig(**{**SMALL, **fields})


@pytest.mark.parametrize("typo,field", [("hiden_size", "hidden_size"), ("num_head", "num_heads"),
                                        ("mixr", "mixer"), ("intermediate_sise", "intermediate_size")])
def test_typos_are_refused_with_the_closest_field(typo, field):
    with pytest.raises(ValueError, match=f"unknown field '{typo}'; did you mean '{field}'"):
        LinmemConfig(**SMALL, **{typo: 16})


@pytest.mark.parametrize("section,typo,key", [("mixer", "windw", "window"), ("mixer", "qk_nrom", "qk_norm"),
                                              ("mom", "num_memory", "num_memories"), ("moe", "num_expert", "num_experts"),
                                              ("liger", "memory_weights", "memory_weight")])
def test_section_typos_are_refused_with_the_closest_key(section, typo, key):
    with pytest.raises(ValueError, match=rf"unknown key '{section}\.{typo}'; did you mean '{section}\.{key}'"):
        LinmemConfig(**SMALL, **{section: {typo: 16}})


@pytest.mark.parametrize("flat,where", [("window", r"mixer=\{'window': ...\}"), ("mom_top_k", r"mom=\{'top_k': ...\}"),
                                        ("num_slots", r"gsa=\{'num_slots': ...\} and liger=\{'num_slots': ...\}")])
def test_a_flat_mixer_option_is_refused_naming_its_section(flat, where):
    with pytest.raises(ValueError, match=f"unknown field '{flat}'; it is a mixer option, give it as {where}"):
        LinmemConfig(**SMALL, **{flat: 4})


def test_a_section_keeps_the_defaults_of_the_keys_it_is_not_given():
    config = LinmemConfig(**SMALL, memory="mom", mom={"top_k": 1}, moe={"num_experts": 4})
    assert config.mom == {"memory": "gated_deltanet", "num_memories": 4, "top_k": 1, "shared_memory": True,
                          "aux_loss_coef": 0.01}
    assert config.moe_args().intermediate_size == config.mlp_width and config.moe_args().num_experts == 4


def test_every_argument_of_every_mixer_is_a_section_key_or_set_by_the_model():
    """A field added to a mixer's arguments class is a config option without editing LinmemConfig."""
    for name in mixer_names():
        args_class = mixer_class(name).args_class
        covered = set(MODEL_SET_ARGS)
        for section, cls in SECTIONS.items():
            if issubclass(args_class, cls):
                covered |= set(section_fields(section).values())
        assert {f.name for f in dataclasses.fields(args_class)} <= covered, name
    moe_fields = set(section_fields("moe").values()) | MODEL_SET_ARGS
    assert {f.name for f in dataclasses.fields(MoEArgs)} <= moe_fields


def test_from_pretrained_merges_given_sections_key_by_key(tmp_path):
    LinmemConfig(**SMALL, mlp="moe", moe={"num_experts": 4, "router": "sigmoid"}).save_pretrained(tmp_path)
    loaded = LinmemConfig.from_pretrained(tmp_path, moe={"num_experts": 2}, mixer={"window": 8})
    assert (loaded.moe["num_experts"], loaded.moe["router"], loaded.mixer["window"]) == (2, "sigmoid", 8)


def test_the_keywords_transformers_passes_are_accepted():
    keys = pretrained_config_keys()
    assert {"architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache",
            "return_dict", "output_hidden_states", "max_length", "id2label"} <= keys
    config = LinmemConfig(**SMALL, architectures=["LinmemForCausalLM"], torch_dtype="float32",
                          transformers_version="5.0.0", output_hidden_states=False)
    assert config.architectures == ["LinmemForCausalLM"]


def test_save_and_load_round_trip(tmp_path):
    config = LinmemConfig(**{**SMALL, "layer_pattern": "LNL"}, attention="fox", memory="kda",
                          mixer=dict(window=8, forget_gate="fixed", qk_norm=True), activation_checkpointing=True)
    config.save_pretrained(tmp_path)
    loaded = LinmemConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert (loaded.mixer["window"], loaded.mixer["forget_gate"], loaded.memory) == (8, "fixed", "kda")


def test_a_window_saved_for_swa_only_is_dropped_for_other_attention(tmp_path):
    """Configs saved before `window` reached every attention mixer (flat, without forget_gate) hold its swa
    default (512) for any mixer."""
    LinmemConfig(**SMALL, attention="fox").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    mixer = {key: value for key, value in saved.pop("mixer").items() if key in FLAT_FIELDS}  # keys of flat configs
    del mixer["forget_gate"], mixer["window"]
    saved = {**saved, **mixer}  # the flat form of those configs
    path.write_text(json.dumps({**saved, "window": 512}))
    assert LinmemConfig.from_pretrained(tmp_path).mixer["window"] is None
    path.write_text(json.dumps({**saved, "window": 512, "attention": "swa"}))
    assert LinmemConfig.from_pretrained(tmp_path).mixer["window"] == 512


def test_each_mixer_takes_its_arguments_from_the_config():
    config = LinmemConfig(**{**SMALL, "layer_pattern": "LN"}, memory="mom", mom=dict(memory="gla", top_k=1),
                          attention="fox", mixer=dict(window=7, forget_gate="data_independent"), rms_norm_eps=1e-5)
    memory, attention = config.mixer_args(0), config.mixer_args(1)
    assert type(memory) is mixer_class("mom").args_class and type(attention) is mixer_class("fox").args_class
    assert (memory.mom_memory, memory.top_k, memory.norm_eps, memory.layer_idx) == ("gla", 1, 1e-5, 0)
    assert (attention.window, attention.forget_gate, attention.layer_idx, attention.num_layers) == \
        (7, "data_independent", 1, 2)
