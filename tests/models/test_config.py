"""LinmemConfig: every bad field is a ValueError naming the field and its valid range, typos get a
"did you mean", the keywords transformers passes are accepted, save -> load round-trips, and each mixer
takes its own arguments from the config (``window`` reaches every attention mixer, FoX included)."""

from __future__ import annotations

import json

import pytest

from linmem.layers import mixer_class
from linmem.models import LinmemConfig
from linmem.models.config import pretrained_config_keys

SMALL = dict(vocab_size=64, hidden_size=32, num_heads=2, layer_pattern="LN")


@pytest.mark.parametrize("fields,message", [
    (dict(num_heads=0), r"`num_heads` must be an integer >= 1, got 0"),
    (dict(hidden_size=-8), r"`hidden_size` must be an integer >= 1, got -8"),
    (dict(hidden_size="32"), r"`hidden_size` must be an integer >= 1, got '32'"),
    (dict(vocab_size=0), r"`vocab_size` must be an integer >= 1"),
    (dict(conv_size=0), r"`conv_size` must be an integer >= 1"),
    (dict(head_dim=0), r"`head_dim` must be an integer >= 1 or None"),
    (dict(expand_v=0), r"`expand_v` must be a finite number > 0"),
    (dict(expand_v=0.3), r"`expand_v` = 16 \* 0.3 must be a whole number"),
    (dict(rms_norm_eps=-1e-6), r"`rms_norm_eps` must be a finite number > 0"),
    (dict(rms_norm_eps=float("nan")), r"`rms_norm_eps` must be a finite number > 0"),
    (dict(window=0), r"`window` must be an integer >= 1 or None"),
    (dict(window=2.5), r"`window` must be an integer >= 1 or None"),
    (dict(qk_norm="yes"), r"`qk_norm` must be True or False"),
    (dict(initializer_range=-0.1), r"`initializer_range` must be a finite number >= 0"),
    (dict(num_kv_heads=3), r"`num_heads` = 2 must be a multiple of `num_kv_heads` = 3"),
    (dict(hidden_size=30, num_heads=4), r"`hidden_size` = 30 is not divisible by `num_heads` = 4"),
    (dict(eos_token_id=64), r"`eos_token_id` must be None or a token id in \[0, vocab_size = 64\)"),
    (dict(attention="swa"), r"swa: `window` must be set"),
    (dict(forget_gate="fixed"), r"softmax: has no forget gate"),
    (dict(attention="fox", forget_gate="learnt"), r"unknown `forget_gate` 'learnt'; valid: data_dependent"),
    (dict(memory="linear_attention", feature_map="cosine"), r"unknown `feature_map` 'cosine'; valid: identity"),
    (dict(memory="mom", mom_memory="rwkv7"), r"unknown `mom_memory` 'rwkv7'; valid: .*kda"),
])
def test_bad_fields_are_refused_with_their_name_and_range(fields, message):
    with pytest.raises(ValueError, match=message):
        LinmemConfig(**{**SMALL, **fields})


@pytest.mark.parametrize("typo,field", [("windw", "window"), ("hiden_size", "hidden_size"),
                                        ("num_head", "num_heads"), ("qk_nrom", "qk_norm")])
def test_typos_are_refused_with_the_closest_field(typo, field):
    with pytest.raises(ValueError, match=f"unknown field '{typo}'; did you mean '{field}'"):
        LinmemConfig(**SMALL, **{typo: 16})


def test_the_keywords_transformers_passes_are_accepted():
    keys = pretrained_config_keys()
    assert {"architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache",
            "return_dict", "output_hidden_states", "max_length", "id2label"} <= keys
    config = LinmemConfig(**SMALL, architectures=["LinmemForCausalLM"], torch_dtype="float32",
                          transformers_version="5.0.0", output_hidden_states=False)
    assert config.architectures == ["LinmemForCausalLM"]


def test_save_and_load_round_trip(tmp_path):
    config = LinmemConfig(**{**SMALL, "layer_pattern": "LNL"}, attention="fox", window=8, forget_gate="fixed",
                          qk_norm=True, memory="kda", activation_checkpointing=True)
    config.save_pretrained(tmp_path)
    loaded = LinmemConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert (loaded.window, loaded.forget_gate, loaded.memory) == (8, "fixed", "kda")


def test_a_window_saved_for_swa_only_is_dropped_for_other_attention(tmp_path):
    """Configs saved before `window` reached every attention mixer hold its swa default (512) for any mixer."""
    LinmemConfig(**SMALL, attention="fox").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    del saved["forget_gate"]
    path.write_text(json.dumps({**saved, "window": 512}))
    assert LinmemConfig.from_pretrained(tmp_path).window is None
    path.write_text(json.dumps({**saved, "window": 512, "attention": "swa"}))
    assert LinmemConfig.from_pretrained(tmp_path).window == 512


def test_each_mixer_takes_its_arguments_from_the_config():
    config = LinmemConfig(**{**SMALL, "layer_pattern": "LN"}, memory="mom", mom_memory="gla", mom_top_k=1,
                          attention="fox", window=7, rms_norm_eps=1e-5, forget_gate="data_independent")
    memory, attention = config.mixer_args(0), config.mixer_args(1)
    assert type(memory) is mixer_class("mom").args_class and type(attention) is mixer_class("fox").args_class
    assert (memory.mom_memory, memory.top_k, memory.norm_eps, memory.layer_idx) == ("gla", 1, 1e-5, 0)
    assert (attention.window, attention.forget_gate, attention.layer_idx, attention.num_layers) == \
        (7, "data_independent", 1, 2)
