"""A trained Gated DeltaNet model turned into a Bayesian-memory model (``linmem.linearize.bayes``): every shared
parameter is copied exactly (the convolutions renamed) and nothing else; with the filter's covariance reset at every
step the converted model computes the source's logits; with its covariance it agrees on a sequence's first token
(r_h = q_h = 1: a write into a fresh direction is Gated DeltaNet's) and differs after; it trains, saves and loads;
a model of another memory and a backend the layer cannot run are refused by name."""

from __future__ import annotations

import pytest
import torch

from linmem.layers.bayes import BayesianMemory
from linmem.linearize import gated_deltanet_to_bayes
from linmem.linearize.bayes import BAYES_ONLY, RENAMED
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.ops import bayes_filter
from tests.helpers import rel_err


def trained_like(pattern: str = "LNL", tie: bool = False, **config) -> LinmemForCausalLM:
    """A Gated DeltaNet model whose every parameter is moved off its init (so a parameter left at the converted
    layer's init, where both layers init alike, would show)."""
    torch.manual_seed(0)
    model = LinmemForCausalLM(LinmemConfig(vocab_size=64, hidden_size=32, num_heads=2, layer_pattern=pattern,
                                           intermediate_size=64, tie_word_embeddings=tie, **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.double().eval()


def reset_filter(layer: BayesianMemory):
    """The layer's memory hook with the covariance reset to the prior at every step (the gated delta rule)."""
    def run_memory(args, state, *, cu_seqlens, output_final_state):
        o, _, _ = bayes_filter(args.q, args.k, args.v, **args.filter_kwargs(), reset=True, cu_seqlens=cu_seqlens)
        return o, None
    return run_memory


@pytest.mark.parametrize("tie", [False, True])
def test_every_shared_parameter_is_copied_exactly_and_nothing_else(tie):
    source = trained_like(tie=tie)
    converted, record = gated_deltanet_to_bayes(source)
    assert converted.config.memory == "bayes" and converted.config.layer_pattern == "LNL"
    assert {k: v for k, v in converted.config.to_dict().items() if k != "memory"} == \
        {k: v for k, v in source.config.to_dict().items() if k != "memory"}
    weights, mine = source.state_dict(), converted.state_dict()
    assert set(record.copied.values()) == set(weights) and set(record.copied) | set(record.initialised) == set(mine)
    for name, origin in record.copied.items():
        assert torch.equal(mine[name], weights[origin]) and mine[name].dtype == torch.float64, name
    renamed = [n for n in record.copied if n != record.copied[n]]
    assert len(renamed) == 2 * len(RENAMED) * 2  # weight and bias of three convolutions in each of two memory layers
    assert sorted(record.initialised) == sorted(f"model.layers.{i}.mixer.{leaf}" for i in (0, 2) for leaf in BAYES_ONLY)
    for layer in (converted.model.layers[0].mixer, converted.model.layers[2].mixer):
        r_h, q_h = (torch.nn.functional.softplus(p) for p in (layer.obs_noise_raw, layer.process_noise_raw))
        assert torch.allclose(r_h, torch.ones_like(r_h)) and torch.allclose(q_h, torch.ones_like(q_h))
    assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tie
    assert not converted.training and source.config.memory == "gated_deltanet"  # the source is left as it is


def test_with_the_covariance_reset_the_converted_model_computes_the_source_logits():
    source = trained_like()
    converted, _ = gated_deltanet_to_bayes(source)
    for layer in converted.modules():
        if isinstance(layer, BayesianMemory):
            layer.run_memory = reset_filter(layer)
    ids = torch.randint(1, 64, (2, 23))
    with torch.no_grad():
        expected, got = source(ids, use_cache=False).logits, converted(ids, use_cache=False).logits
    assert rel_err(got, expected) < 1e-5  # 7e-7 measured: the keys' L2-norm epsilons differ (1e-6 against none)


def test_with_its_covariance_it_agrees_on_the_first_token_and_differs_after():
    source = trained_like()
    converted, _ = gated_deltanet_to_bayes(source)
    ids = torch.randint(1, 64, (2, 23))
    with torch.no_grad():
        expected, got = source(ids, use_cache=False).logits, converted(ids, use_cache=False).logits
    assert rel_err(got[:, 0], expected[:, 0]) < 1e-5  # a first write into P = I is Gated DeltaNet's write
    assert rel_err(got[:, 1:], expected[:, 1:]) > 1e-4  # later ones are steered and shrunk by the covariance


def test_the_converted_model_trains_saves_and_loads(tmp_path):
    converted, _ = gated_deltanet_to_bayes(trained_like().float().train())
    ids = torch.randint(1, 64, (2, 17))
    converted(input_ids=ids, labels=ids).loss.backward()
    for name, p in converted.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    converted.eval().save_pretrained(tmp_path)
    loaded = LinmemForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.memory == "bayes"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, converted(ids).logits)


def test_other_memories_and_backends_are_refused_by_name():
    with pytest.raises(ValueError, match="`memory` must be 'gated_deltanet', got 'gla'"):
        gated_deltanet_to_bayes(LinmemForCausalLM(LinmemConfig(vocab_size=64, hidden_size=32, num_heads=2,
                                                               layer_pattern="L", memory="gla")))
    with pytest.raises(ValueError, match="backend"):
        gated_deltanet_to_bayes(trained_like(), backend="chunk")
    with pytest.raises(TypeError, match="`model` must be a LinmemForCausalLM"):
        gated_deltanet_to_bayes(torch.nn.Linear(2, 2))
