"""Every config.json written before the mixer sections still loads, into the same model.

``legacy_configs/*`` were saved by the flat LinmemConfig (``mom_top_k``, ``num_experts``, ``liger_window``,
``window``, ... beside the model's fields), each with the logits of a fixed input and a training loss.
"""

import json
from pathlib import Path

import pytest
import torch

from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models.config import FLAT_FIELDS, SECTIONS, nest_flat_fields, section_fields

FIXTURES = Path(__file__).parent / "legacy_configs"
NAMES = sorted(p.name for p in FIXTURES.iterdir())


def test_the_fixtures_are_there():
    assert NAMES == ["gsa", "hybrid-window", "liger-linearized", "mom-moe"]


@pytest.mark.parametrize("name", NAMES)
def test_an_old_checkpoint_loads_into_the_same_model(name):
    folder = FIXTURES / name
    expected = json.loads((folder / "expected.json").read_text())
    model = LinmemForCausalLM.from_pretrained(folder).eval()
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == expected["state_dict_shapes"]
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-5)
    model.train()
    with torch.no_grad():
        loss = model(ids, labels=ids, use_cache=False).loss
    assert loss.item() == pytest.approx(expected["train_loss"], rel=1e-5)  # the routers' loss weights came along


@pytest.mark.parametrize("name", NAMES)
def test_an_old_config_maps_every_flat_field_into_its_section(name, tmp_path):
    saved = json.loads((FIXTURES / name / "config.json").read_text())
    config = LinmemConfig.from_pretrained(FIXTURES / name)
    for field, places in FLAT_FIELDS.items():
        for section, key in places:
            if field == "window":
                continue  # an old config without forget_gate keeps its window for swa only
            assert getattr(config, section)[key] == saved[field], (field, section, key)
    config.save_pretrained(tmp_path)  # and it saves in the new form, which loads as it is
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert not set(resaved) & set(FLAT_FIELDS)
    assert LinmemConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


def test_the_old_fields_of_the_fixtures_are_read():
    mom = LinmemConfig.from_pretrained(FIXTURES / "mom-moe")
    assert mom.mom == {"memory": "gla", "num_memories": 3, "top_k": 1, "shared_memory": False, "aux_loss_coef": 0.05}
    assert (mom.moe["num_experts"], mom.moe["intermediate_size"], mom.moe["router"]) == (4, 8, "sigmoid")
    assert (mom.moe["aux_loss_coef"], mom.moe["z_loss_coef"], mom.mixer["use_short_conv"]) == (0.02, 0.003, True)
    liger = LinmemConfig.from_pretrained(FIXTURES / "liger-linearized")
    assert (liger.liger["window"], liger.liger["memory_weight"], liger.mixer["num_kv_heads"]) == (4, 0.25, 1)
    assert liger.llama_attention == {"qkv_bias": True, "o_bias": False,
                                     "rope_scaling_params": {"rope_type": "linear", "factor": 2.0}}
    assert LinmemConfig.from_pretrained(FIXTURES / "gsa").gsa == {"num_slots": 4}
    hybrid = LinmemConfig.from_pretrained(FIXTURES / "hybrid-window")
    assert (hybrid.mixer["window"], hybrid.mixer["head_dim"], hybrid.mixer["qk_norm"]) == (3, 8, True)


def test_every_section_key_has_an_old_flat_name_or_is_new():
    """The flat names cover what the flat config had; keys added with the sections have none."""
    new = {("moe", "expert_backend"), ("mixer", "rope"), ("mixer", "prune_tolerance"), ("titans", "momentum")}
    mapped = {place for places in FLAT_FIELDS.values() for place in places}
    assert {(name, key) for name in SECTIONS for key in section_fields(name)} - mapped == new


def test_flat_fields_are_nested_and_the_rest_kept():
    assert nest_flat_fields({"layer_pattern": "LN", "window": 64, "num_slots": 4, "liger_window": 8}) == {
        "layer_pattern": "LN", "mixer": {"window": 64}, "gsa": {"num_slots": 4}, "liger": {"num_slots": 4, "window": 8}}
    assert nest_flat_fields({"mixer": {"window": 64}}) == {"mixer": {"window": 64}}


def test_a_window_saved_before_forget_gate_is_dropped_for_softmax_only():
    old = {"layer_pattern": "LN", "hidden_size": 32, "num_heads": 2, "window": 64, "head_dim": 8}
    assert LinmemConfig.from_dict(old).mixer["window"] is None
    assert LinmemConfig.from_dict({**old, "attention": "swa"}).mixer["window"] == 64
    assert LinmemConfig.from_dict({**old, "forget_gate": "data_dependent"}).mixer["window"] == 64
