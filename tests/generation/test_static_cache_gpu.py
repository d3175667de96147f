"""CUDA-graph decoding (GPU only): graph replays equal eager steps, replays never synchronise with the host,
generate(cache_implementation="static") gives the dynamic cache's tokens, a long prompt prefills in chunks."""

from __future__ import annotations

import pytest
import torch

from linmem.generation import GraphDecoder, decode_step
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models.cache import LinmemCache, StaticLinmemCache
from linmem.models.outputs import output_cache

pytestmark = pytest.mark.gpu

VOCAB = 256
PRO = dict(qk_norm=True, output_gate=True, output_norm=True, kv_shift=True)
MODELS = {  # head dim 64: the Triton kernels serve every attention and recurrence call
    "hybrid": dict(layer_pattern="LNLN", memory="gla", attention="fox", mixer=dict(use_short_conv=True, **PRO)),
    "swa+gated_deltanet": dict(layer_pattern="LN", memory="gated_deltanet", attention="swa", mixer=dict(window=16)),
    "transformer": dict(layer_pattern="NN", attention="softmax", mixer=dict(num_kv_heads=1)),
}


def tiny(dtype=torch.float32, **over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=VOCAB, hidden_size=128, num_heads=2, intermediate_size=256, **over)
    return LinmemForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def left_padded(lengths=(40, 23, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, width - n:] = 1
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_graph_replay_equals_eager_and_never_synchronises(name):
    model = tiny(**MODELS[name])
    ids, mask = left_padded()
    steps = 24  # the window's ring wraps
    caches = [StaticLinmemCache(len(model.model.layers), batch_size=3, max_cache_len=ids.shape[1] + steps,
                                device="cuda") for _ in range(2)]
    first = [model(ids, attention_mask=mask, cache=c, logits_to_keep=1).logits[:, -1:].argmax(-1) for c in caches]
    eager, graphed = [], []
    decoder = GraphDecoder(model, caches[1])
    token_e, token_g = first
    for step in range(steps):
        if step >= 2:  # warmed up and captured: neither an eager step nor a replay waits for the device
            torch.cuda.set_sync_debug_mode("error")
        try:
            logits_e = decode_step(model, token_e, caches[0])
            caches[0].advance_host(1)
            logits_g = decoder.step(caches[1], token_g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager.append(logits_e)
        graphed.append(logits_g)
        token_e, token_g = logits_e[:, -1:].argmax(-1), logits_g[:, -1:].argmax(-1)
    assert decoder.graph is not None
    torch.testing.assert_close(torch.cat(graphed, 1), torch.cat(eager, 1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="max_cache_len"):
        decoder.step(caches[1], token_g)
    with pytest.raises(ValueError, match="another cache"):
        decoder.step(caches[0], token_g)


@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_static_generate_equals_dynamic_on_cuda(name):
    model = tiny(**MODELS[name])
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert isinstance(output_cache(static), StaticLinmemCache) and output_cache(static).decoder.graph is not None
    assert torch.equal(static.sequences, dynamic.sequences)


@torch.no_grad()
def test_long_prompt_prefills_in_chunks_on_cuda():
    model = tiny(**MODELS["hybrid"])
    ids = torch.randint(1, VOCAB, (2, 3000), device="cuda")
    chunked = model(ids, cache=LinmemCache(4, prefill_chunk=1024), logits_to_keep=1).logits
    whole = model(ids, cache=LinmemCache(4, prefill_chunk=4096), logits_to_keep=1).logits
    assert chunked.shape == (2, 1, VOCAB)  # the kernels' TF32 products differ with the chunking
    assert float((chunked - whole).square().mean().sqrt() / whole.square().mean().sqrt()) < 1e-2


@torch.no_grad()
def test_graph_replay_takes_position_ids_as_generate_passes_them():
    model = tiny(**MODELS["hybrid"])
    ids, mask = left_padded()
    caches = [StaticLinmemCache(len(model.model.layers), batch_size=3, max_cache_len=ids.shape[1] + 6,
                                device="cuda") for _ in range(2)]
    token = torch.stack([model(ids, attention_mask=mask, cache=c, logits_to_keep=1).logits[:, -1:].argmax(-1)
                         for c in caches])[0]
    decoder = GraphDecoder(model, caches[1])
    for step in range(6):  # positions 100 past the real ones: not what the cache would give
        positions = mask.sum(1, keepdim=True) + step + 100
        eager = decode_step(model, token, caches[0], positions)
        caches[0].advance_host(1)
        graphed = decoder.step(caches[1], token, positions)
        torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-5)
        token = eager[:, -1:].argmax(-1)
    assert decoder.graph is not None
