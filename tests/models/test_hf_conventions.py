"""Hugging Face's conventions, without transformers' own test sources: generate() from inputs_embeds alone and with
hidden states, prepare_inputs_for_generation passing keywords on, the config's output_hidden_states / return_dict /
use_cache defaults, return_dict=False tuples, shift_labels and num_items_in_batch in the loss (fused and not),
the common PretrainedConfig keywords kept, output_attentions refused by name, position_ids in a static decoding
step."""

from __future__ import annotations

import pytest
import torch

from linmem.generation import decode_step
from linmem.models import LinmemCache, LinmemConfig, LinmemForCausalLM, LinmemModel, StaticLinmemCache
from linmem.models.modeling import causal_lm_loss, next_token_targets
from linmem.models.outputs import CACHE_NAME, output_cache

VOCAB = 99


def config(**over) -> LinmemConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_heads=2, layer_pattern="LLN", intermediate_size=64)
    return LinmemConfig(**{**fields, **over})


def tiny(**over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    return LinmemForCausalLM(config(**over)).eval()


def prompt(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def greedy(model, *args, **kwargs):
    with torch.no_grad():
        return model.generate(*args, max_new_tokens=4, do_sample=False, pad_token_id=0, **kwargs)


def test_generate_from_inputs_embeds_alone_and_beside_input_ids():
    model, ids = tiny(), prompt()
    embeds = model.get_input_embeddings()(ids).detach()
    mask = torch.ones_like(ids)
    from_ids = greedy(model, ids, attention_mask=mask)
    assert torch.equal(greedy(model, inputs_embeds=embeds, attention_mask=mask), from_ids[:, ids.shape[1]:])
    assert torch.equal(greedy(model, inputs_embeds=embeds), from_ids[:, ids.shape[1]:])
    assert torch.equal(greedy(model, ids, inputs_embeds=embeds, attention_mask=mask), from_ids)


def test_generate_returns_the_hidden_states_of_every_step():
    model, ids = tiny(), prompt()
    out = greedy(model, ids, return_dict_in_generate=True, output_hidden_states=True)
    assert len(out.hidden_states) == 4
    for step, states in enumerate(out.hidden_states):  # the prompt, then one token a step
        assert len(states) == model.config.num_hidden_layers + 1
        assert all(h.shape == (2, ids.shape[1] if step == 0 else 1, 32) for h in states)
    with torch.no_grad():
        forward = model(out.sequences[:, :-1], output_hidden_states=True, use_cache=False).hidden_states
    steps = [torch.cat(layer, 1) for layer in zip(*out.hidden_states)]
    for got, want in zip(steps, forward):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_prepare_inputs_for_generation_passes_keywords_on():
    model, ids = tiny(), prompt(length=6)
    cache = LinmemCache(3)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
    positions = torch.arange(6)[None].expand(2, 6)
    inputs = model.prepare_inputs_for_generation(
        ids, cache=cache, attention_mask=torch.ones_like(ids), position_ids=positions, output_hidden_states=True,
        my_keyword="kept", next_sequence_length=2, is_first_iteration=False, labels=ids)
    assert torch.equal(inputs["input_ids"], ids[:, 4:]) and torch.equal(inputs["position_ids"], positions[:, 4:])
    assert inputs["output_hidden_states"] is True and inputs["my_keyword"] == "kept" and inputs[CACHE_NAME] is cache
    assert not {"next_sequence_length", "is_first_iteration", "labels"} & set(inputs)


@pytest.mark.parametrize("model_class", [LinmemModel, LinmemForCausalLM])
def test_config_defaults_of_hidden_states_return_dict_and_use_cache(model_class):
    ids = prompt()
    torch.manual_seed(0)
    model = model_class(config(output_hidden_states=True, use_cache=False)).eval()
    with torch.no_grad():
        out = model(ids)
        assert len(out.hidden_states) == 4 and getattr(out, CACHE_NAME) is None
        assert getattr(model(ids, use_cache=True), CACHE_NAME) is not None
        model.config.return_dict = False
        as_tuple = model(ids)
        model.config.return_dict = True
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(out.to_tuple())
    for got, want in zip(as_tuple, out.to_tuple()):
        torch.testing.assert_close(got, want)


def test_return_dict_false_puts_the_loss_first():
    model, ids = tiny(), prompt()
    with torch.no_grad():
        out = model(ids, labels=ids, return_logits=True)
        as_tuple = model(ids, labels=ids, return_logits=True, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.loss)
    torch.testing.assert_close(as_tuple[1], out.logits)


def test_shift_labels_are_the_targets_of_the_fused_and_the_plain_loss():
    model, ids = tiny(), prompt()
    shifted = next_token_targets(ids)
    other = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
        from_labels = model(ids, labels=ids).loss
        torch.testing.assert_close(model(ids, shift_labels=shifted).loss, from_labels)
        torch.testing.assert_close(model(ids, labels=other, shift_labels=shifted).loss, from_labels)  # labels unread
        moved = model(ids, labels=ids, shift_labels=other).loss
    torch.testing.assert_close(moved, causal_lm_loss(logits, ids, shift_labels=other))
    assert not torch.equal(moved, from_labels)


def test_num_items_in_batch_divides_the_summed_loss():
    model, ids = tiny(), prompt()
    with torch.no_grad():
        mean = model(ids, labels=ids).loss
        summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(40)).loss
    torch.testing.assert_close(summed, mean * (ids.numel() - ids.shape[0]) / 40)


def test_common_pretrained_config_keywords_are_kept(tmp_path):
    common = dict(use_cache=False, output_hidden_states=True, return_dict=False, tie_word_embeddings=True,
                  pad_token_id=7, bos_token_id=6, eos_token_id=8, chunk_size_feed_forward=5,
                  architectures=["LinmemForCausalLM"], id2label={0: "label"}, label2id={"label": 0},
                  problem_type="regression")
    made = config(**common)
    made.save_pretrained(tmp_path)
    for loaded in (made, LinmemConfig.from_pretrained(tmp_path)):
        assert {key: getattr(loaded, key) for key in common} == common


def test_output_attentions_is_refused_by_name():
    model, ids = tiny(), prompt()
    with pytest.raises(ValueError, match="`output_attentions` must be False"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="`output_attentions` must be False"):
        greedy(model, ids, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="the config's `output_attentions`"):
        LinmemModel(config(output_attentions=True))(ids)
    assert model(ids, output_attentions=False).logits.shape == (2, 5, VOCAB)


def test_static_decoding_step_takes_position_ids():
    model, ids = tiny(layer_pattern="LN"), prompt()
    caches = [StaticLinmemCache(2, batch_size=2, max_cache_len=8, device="cpu") for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache)
        token = torch.tensor([[3], [4]])
        default = decode_step(model, token, caches[0])
        given = decode_step(model, token, caches[1], position_ids=torch.tensor([[5], [5]]))
        cache = output_cache(model(ids, cache=LinmemCache(2)))
        shifted = model(token, cache=cache, position_ids=torch.tensor([[9], [9]]))
    torch.testing.assert_close(given, default)
    assert not torch.allclose(shifted.logits, default, atol=1e-4)  # the positions reach the attention layer
