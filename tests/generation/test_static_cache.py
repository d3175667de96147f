"""The static cache: generate(cache_implementation="static") gives the dynamic cache's tokens (and logits) for
every mixer kind on a left-padded batch, greedy, sampled with stop tokens and with beams; its tensors never move
after the prefill; a chunked prefill equals one pass; FoX's re-basing changes nothing; bad uses get named errors."""

from __future__ import annotations

import pytest
import torch

from linmem.generation import graph_refusal
from linmem.layers import attention, mixer_names
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models import cache as cache_module
from linmem.models.cache import LinmemCache, StaticLinmemCache
from linmem.models.config import merge_fields
from linmem.models.outputs import output_cache

VOCAB = 64
PRO = dict(qk_norm=True, output_gate=True, output_norm=True, kv_shift=True)
ATTENTION = ["softmax", "swa", "fox"]
MEMORY = [m for m in mixer_names("memory") if m != "mom"]
# every memory mixer beside one attention kind in turn (swa and windows small enough for the ring to wrap)
MODELS = {f"{m}+{a}": dict(layer_pattern="LN", memory=m, attention=a, mixer={} if a == "softmax" else {"window": 4})
          for m, a in zip(MEMORY, ATTENTION * len(MEMORY))}
MODELS |= {
    "transformer": dict(layer_pattern="NN", attention="softmax", mixer=dict(num_kv_heads=1)),
    "fox-pro-window": dict(layer_pattern="N", attention="fox", mixer=dict(window=5, **PRO)),
    "fox-pro-fixed-gate": dict(layer_pattern="N", attention="fox", mixer=dict(forget_gate="fixed", **PRO)),
    "hybrid": dict(layer_pattern="LLNL", memory="gated_deltanet", attention="fox"),
    "mom": dict(layer_pattern="LN", memory="mom", mom=dict(memory="gla"), mixer=dict(use_short_conv=True)),
    "moe": dict(layer_pattern="LN", memory="gla", mlp="moe", moe=dict(num_experts=4, num_experts_per_tok=2)),
}


def tiny(**over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(**merge_fields(dict(vocab_size=VOCAB, hidden_size=32, num_heads=2, intermediate_size=64,
                                              moe=dict(intermediate_size=32)), over))
    return LinmemForCausalLM(config).eval()


def left_padded(lengths=(7, 4, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,))
        mask[row, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, implementation, new=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              cache_implementation=implementation, return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_generate_equals_dynamic(name):
    torch.set_num_threads(1)
    model = tiny(**MODELS[name])
    ids, mask = left_padded()
    dynamic, static = generate(model, ids, mask, None), generate(model, ids, mask, "static")
    assert type(output_cache(static)) is StaticLinmemCache and type(output_cache(dynamic)) is LinmemCache
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=0, atol=1e-5)
    assert output_cache(static).lengths.tolist() == (mask.sum(1) + 5).tolist()  # the last token is never fed back


def test_static_tensors_never_move_after_the_prefill():
    torch.set_num_threads(1)
    model = tiny(layer_pattern="LNLN", memory="gla", attention="fox", mixer=dict(window=3, use_short_conv=True, **PRO))
    ids, mask = left_padded()
    cache = StaticLinmemCache(4, batch_size=3, max_cache_len=ids.shape[1] + 8, device="cpu")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)
        where = [(t.data_ptr(), t.shape) for t in cache.tensors()]
        for _ in range(8):  # the window's ring wraps twice
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
            assert [(t.data_ptr(), t.shape) for t in cache.tensors()] == where
    assert output_cache(out) is cache and cache.get_seq_length() == ids.shape[1] + 8
    with pytest.raises(ValueError, match="holds 15 tokens"):
        model(out.logits[:, -1:].argmax(-1), cache=cache)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_chunked_prefill_equals_one_pass(static):
    torch.set_num_threads(1)
    model = tiny(layer_pattern="LNL", memory="gated_deltanet", attention="fox", mixer=dict(window=6))
    ids, mask = left_padded((11, 5))

    def make(chunk):
        if static:
            return StaticLinmemCache(3, batch_size=2, max_cache_len=16, device="cpu", prefill_chunk=chunk)
        return LinmemCache(3, prefill_chunk=chunk)

    with torch.no_grad():
        results = []
        for chunk in (4, 64):
            cache = make(chunk)
            logits = [model(ids, attention_mask=mask, cache=cache, logits_to_keep=4).logits]  # 2 chunks of 4
            for _ in range(3):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                logits.append(model(logits[-1][:, -1:].argmax(-1), attention_mask=mask, cache=cache).logits)
            mask = mask[:, :-3]
            results.append(torch.cat(logits, 1))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)


def test_fox_rebasing_changes_nothing(monkeypatch):
    torch.set_num_threads(1)
    model = tiny(layer_pattern="LN", memory="gla", attention="fox")
    ids, mask = left_padded((6, 3))
    reference = generate(model, ids, mask, None, new=9)
    calls = []
    for module in (attention, cache_module):  # re-base at every 4th token
        monkeypatch.setattr(module, "REBASE_EVERY", 4)
        counted = lambda state, run=module.rebase_forget: calls.append(1) or run(state)  # noqa: E731
        monkeypatch.setattr(module, "rebase_forget", counted)
    for implementation in (None, "static"):
        calls.clear()
        out = generate(model, ids, mask, implementation, new=9)
        assert len(calls) == (14 // 4) * (1 if implementation is None else 2)  # the FoX layer (static: each layer)
        assert torch.equal(out.sequences, reference.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), rtol=0, atol=1e-5)


def test_graph_refusal_names_what_cannot_be_captured():
    cache = StaticLinmemCache(2, batch_size=1, max_cache_len=4, device="cpu")
    assert "MoEFeedForward" in graph_refusal(tiny(**MODELS["moe"]), cache)
    assert "MixtureOfMemories" in graph_refusal(tiny(**MODELS["mom"]), cache)
    assert "CUDA" in graph_refusal(tiny(layer_pattern="LN"), cache)


def test_bad_uses_are_named():
    model = tiny(layer_pattern="LN")
    ids, mask = left_padded((3, 2))
    with pytest.raises(ValueError, match="cache_implementation 'static' or 'dynamic'"):
        generate(model, ids, mask, "offloaded")
    cache = StaticLinmemCache(2, batch_size=2, max_cache_len=8, device="cpu")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        with pytest.raises(ValueError, match="batch size 2"):
            model(ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="max_cache_len"):
        StaticLinmemCache(2, batch_size=2, max_cache_len=0, device="cpu")
    with pytest.raises(ValueError, match="fixed batch size"):
        cache.batch_repeat_interleave(2)


def test_sampling_stop_tokens_and_beams_match_the_dynamic_cache():
    torch.set_num_threads(1)
    model = tiny(**MODELS["hybrid"])
    ids, mask = left_padded()
    sampled = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, eos_token_id=[5, 9, 17])
    beams = dict(do_sample=False, num_beams=3, num_return_sequences=2)  # beams reorder the cache in place
    for options in (sampled, beams):
        runs = []
        for implementation in (None, "static"):
            torch.manual_seed(3)
            with torch.no_grad():
                runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                                           cache_implementation=implementation, **options))
        assert torch.equal(runs[0], runs[1])
