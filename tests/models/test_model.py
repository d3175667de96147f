"""The one configurable model: decoding equals the forward for every mixer and for hybrids,
packed batches equal padded ones, generate() equals an argmax loop, save -> load is exact,
and a pure memory model decodes in constant memory (DESIGN section 7, invariants 4 and 5)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from linmem.layers import mixer_names
from linmem.models import MODEL_RECIPES, LinmemCache, LinmemConfig, LinmemForCausalLM

VOCAB = 64
MODELS = [("LL", memory, "softmax") for memory in mixer_names("memory")]
MODELS += [("LNL", "gated_deltanet", attention) for attention in mixer_names("attention")]
MODELS += [("NLLN", "gla", "swa"), ("LN", "mamba2", "fox")]
MODELS = [m for m in MODELS if m[1] in mixer_names("memory") and m[2] in mixer_names("attention")]


def model_id(m):
    return f"{m[0]}-{m[1]}-{m[2]}"


def tiny(pattern: str, memory: str, attention: str, **over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, layer_pattern=pattern, memory=memory,
                          attention=attention, window=6, intermediate_size=64, **over)
    return LinmemForCausalLM(config).eval()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("spec", MODELS, ids=model_id)
def test_prefill_and_decode_equal_forward(spec):
    model = tiny(*spec)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5])
        cache, logits = out.past_key_values, [out.logits]
        for t in range(5, 12):
            out = model(ids[:, t : t + 1], past_key_values=cache)
            logits.append(out.logits)
    assert rel(torch.cat(logits, 1), full) < 1e-4


@pytest.mark.parametrize("spec", MODELS, ids=model_id)
def test_left_padded_generation_equals_each_prompt_alone(spec):
    model = tiny(*spec)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (7, 4)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(batch[i, width:], alone[0, len(p) :]), f"prompt {i}"
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        for i, p in enumerate(prompts):
            assert rel(logits[i, width - len(p) :], model(p[None], use_cache=False).logits[0]) < 1e-4


@pytest.mark.parametrize("spec", MODELS, ids=model_id)
def test_packed_varlen_equals_sequences_alone(spec):
    model = tiny(*spec)
    lengths = [5, 9, 3]
    seqs = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=False).logits
        for i, s in enumerate(seqs):
            assert rel(packed[0, cu[i] : cu[i + 1]], model(s[None], use_cache=False).logits[0]) < 1e-4


@pytest.mark.parametrize("spec", MODELS[:3] + MODELS[-3:], ids=model_id)
def test_greedy_generate_equals_argmax_loop(spec):
    model = tiny(*spec)
    ids = torch.randint(1, VOCAB, (2, 6))  # 0 is the pad token: generate() would mask it
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        x = ids
        for _ in range(8):
            nxt = model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], 1)
    assert torch.equal(generated, x)


@pytest.mark.parametrize("spec", MODELS[:2] + MODELS[-2:], ids=model_id)
def test_save_load_gives_identical_logits(spec, tmp_path):
    model = tiny(*spec)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert type(loaded) is LinmemForCausalLM and loaded.config.layer_pattern == spec[0]


def test_loss_shifts_labels_ignores_minus_100_and_packed_boundaries():
    model = tiny("LL", "gated_deltanet", "softmax")
    ids = torch.randint(0, VOCAB, (1, 10))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(ids, labels=labels, use_cache=False)
    manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    assert torch.allclose(out.loss, manual)
    cu = torch.tensor([0, 4, 10])
    packed = model(ids, labels=ids, cu_seqlens=cu, use_cache=False)
    keep = torch.ones(9, dtype=torch.bool)
    keep[3] = False  # token 3 ends sequence 0 and must not predict token 4
    manual = torch.nn.functional.cross_entropy(packed.logits[0, :-1][keep], ids[0, 1:][keep])
    assert torch.allclose(packed.loss, manual)


def test_pure_memory_cache_has_constant_size():
    model = tiny("LL", "gated_deltanet", "softmax")
    sizes, start = {}, time.perf_counter()
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (1, 4)))
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for step in range(1, 10_001):
            out = model(token, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            if step in (100, 10_000):
                sizes[step] = cache.nbytes()
    print(f"\ncache bytes after 100 generated tokens: {sizes[100]}, after 10,000: {sizes[10_000]} "
          f"({time.perf_counter() - start:.1f} s)")
    assert sizes[100] == sizes[10_000] > 0


def test_config_refuses_unknown_names():
    with pytest.raises(ValueError, match="valid: .*gated_deltanet"):
        LinmemConfig(memory="lstm")
    with pytest.raises(ValueError, match="unknown attention"):
        LinmemConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown letters"):
        LinmemConfig(layer_pattern="LLX")
    with pytest.raises(ValueError, match="disagrees"):
        LinmemConfig(layer_pattern="LL", num_hidden_layers=3)


def test_auto_classes_build_linmem():
    config = AutoConfig.for_model("linmem", vocab_size=VOCAB, hidden_size=32, num_heads=2, layer_pattern="LN")
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, LinmemForCausalLM) and isinstance(config, LinmemConfig)


@pytest.mark.parametrize("name", list(MODEL_RECIPES))
def test_recipe_parameter_counts_on_meta_device(name):
    recipe = MODEL_RECIPES[name]
    with torch.device("meta"):
        model = LinmemForCausalLM(recipe.build_config())
    count = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"\n{name}: {count:.1f}M parameters (nominal {recipe.nominal_params}M)")
    assert 0.8 * recipe.nominal_params <= count <= 1.25 * recipe.nominal_params, f"{count:.1f}M"


def test_cache_is_a_transformers_cache():
    from transformers.cache_utils import Cache

    cache = LinmemCache(3)
    assert isinstance(cache, Cache) and cache.get_seq_length() == 0 and len(cache) == 3
