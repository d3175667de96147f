"""Initialisation: ``_init_weights`` (what transformers calls for parameters a checkpoint lacks) gives
every parameter of every module the distribution its constructor gives it, and never touches a loaded
parameter: a LinmemModel checkpoint loaded as a LinmemForCausalLM, tied -> untied embeddings, an
extra layer."""

from __future__ import annotations

import pytest
import torch

from linmem.layers import mixer_names
from linmem.models import LinmemConfig, LinmemForCausalLM, LinmemModel
from linmem.models.config import merge_fields

VOCAB = 64
PRO = dict(qk_norm=True, output_gate=True, output_norm=True, kv_shift=True)
CONFIGS = {f"{memory}+softmax-pro": dict(memory=memory, attention="softmax", mixer=dict(use_short_conv=True, **PRO))
           for memory in mixer_names("memory")}
CONFIGS["mom-kda+moe"] = dict(memory="mom", mom=dict(memory="kda"), mlp="moe",
                              moe=dict(num_experts=4, num_shared_experts=1))
CONFIGS["fox-data_independent"] = dict(attention="fox", mixer=dict(forget_gate="data_independent", **PRO))


def config_of(name: str, **over) -> LinmemConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_heads=2, layer_pattern="LN", intermediate_size=64,
                  moe=dict(intermediate_size=32))
    return LinmemConfig(**merge_fields(merge_fields(fields, CONFIGS[name]), over))


def built(config: LinmemConfig, seed: int) -> LinmemForCausalLM:
    torch.manual_seed(seed)
    return LinmemForCausalLM(config)


def assert_same_family(name: str, got: torch.Tensor, fresh: list[torch.Tensor]) -> None:
    """``got`` is finite and drawn as the constructor draws: equal where the constructor's init is
    deterministic (same values for every seed), else inside the fresh values' range and of their spread."""
    assert torch.isfinite(got).all(), f"{name}: not finite"
    if all(torch.equal(fresh[0], f) for f in fresh[1:]):
        assert torch.equal(got, fresh[0]), f"{name}: differs from its deterministic init"
        return
    low, high = min(float(f.min()) for f in fresh), max(float(f.max()) for f in fresh)
    margin = (0.5 if got.numel() >= 16 else 1.0) * (high - low)  # few values: a wider envelope
    assert low - margin <= float(got.min()) and float(got.max()) <= high + margin, f"{name}: outside its init range"
    if got.numel() >= 64:
        spread = [float(f.std()) for f in fresh]
        assert 0.7 * min(spread) <= float(got.std()) <= 1.4 * max(spread), f"{name}: spread {float(got.std())}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_weights_gives_every_parameter_its_constructors_distribution(name):
    config = config_of(name)
    fresh = [dict(built(config, seed).named_parameters()) for seed in range(1, 6)]
    model = built(config, 9)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    for module in reversed(list(model.modules())):  # children before parents, as transformers visits them
        model._init_weights(module)
    for key, p in model.named_parameters():
        assert_same_family(key, p.detach(), [f[key].detach() for f in fresh])


def assert_loaded(loaded: torch.nn.Module, saved: dict[str, torch.Tensor], prefix: str = "") -> None:
    state = loaded.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[prefix + key], value), f"{prefix + key} was not kept as loaded"


def assert_normal(weight: torch.Tensor, std: float) -> None:
    assert torch.isfinite(weight).all() and abs(float(weight.std()) / std - 1) < 0.1 and abs(float(weight.mean())) < std


def test_missing_lm_head_is_initialised_and_the_rest_kept(tmp_path):
    config = config_of("gated_deltanet+softmax-pro")
    torch.manual_seed(0)
    base = LinmemModel(config)
    base.save_pretrained(tmp_path)
    model = LinmemForCausalLM.from_pretrained(tmp_path)
    assert_loaded(model, base.state_dict(), prefix="model.")
    assert_normal(model.lm_head.weight.detach(), config.initializer_range)


def test_tied_checkpoint_loaded_untied_gets_a_new_lm_head(tmp_path):
    tied = built(config_of("gla+softmax-pro", tie_word_embeddings=True), 0)
    tied.save_pretrained(tmp_path)
    untied = LinmemForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert torch.equal(untied.model.embed_tokens.weight, tied.model.embed_tokens.weight)
    assert_normal(untied.lm_head.weight.detach(), untied.config.initializer_range)


def test_an_extra_layer_is_initialised_and_the_loaded_layers_kept(tmp_path):
    name = "mamba2+softmax-pro"
    small = built(config_of(name), 0)
    small.save_pretrained(tmp_path)
    bigger = LinmemForCausalLM.from_pretrained(tmp_path, config=config_of(name, layer_pattern="LNL"))
    assert_loaded(bigger, small.state_dict())
    fresh = [dict(built(config_of(name, layer_pattern="LNL"), seed).named_parameters()) for seed in range(1, 6)]
    for key, p in bigger.named_parameters():
        if key.startswith("model.layers.2."):
            assert_same_family(key, p.detach(), [f[key].detach() for f in fresh])


def test_a_module_missing_one_parameter_keeps_its_loaded_ones(tmp_path):
    """Mamba-2's reset sets A_log, dt_bias and D: with only A_log missing, dt_bias and D stay as loaded."""
    from safetensors.torch import load_file, save_file

    model = built(config_of("mamba2+softmax-pro"), 0)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    missing = "model.layers.0.mixer.A_log"
    save_file({k: v for k, v in weights.items() if k != missing}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = LinmemForCausalLM.from_pretrained(tmp_path)
    assert_loaded(loaded, {k: v for k, v in model.state_dict().items() if k != missing})
    fresh = [dict(built(config_of("mamba2+softmax-pro"), seed).named_parameters())[missing] for seed in range(1, 6)]
    assert_same_family(missing, loaded.get_parameter(missing).detach(), [f.detach() for f in fresh])
