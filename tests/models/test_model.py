"""The one configurable model: decoding equals the forward for every mixer and for hybrids,
packed batches equal padded ones, generate() equals an argmax loop and reuses its cache, save ->
load is exact, a pure memory model decodes in constant memory, activation checkpointing gives the
same loss and gradients with fewer saved activations, bad inputs get named errors."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from linmem.layers import mixer_names
from linmem.models import MODEL_RECIPES, LinmemCache, LinmemConfig, LinmemForCausalLM
from linmem.models.config import merge_fields
from linmem.models.outputs import output_cache

VOCAB = 64
MODELS = [("LL", memory, "softmax") for memory in mixer_names("memory")]
MODELS += [("LNL", "gated_deltanet", attention) for attention in mixer_names("attention")]
MODELS += [("NLLN", "gla", "swa"), ("LN", "mamba2", "fox")]


def model_id(m):
    return f"{m[0]}-{m[1]}-{m[2]}"


def tiny(pattern: str, memory: str, attention: str, **over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    over = merge_fields({"mixer": {"window": 6}}, over) if attention == "swa" else over
    config = LinmemConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, layer_pattern=pattern, memory=memory,
                          attention=attention, intermediate_size=64, **over)
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
        cache, logits = output_cache(out), [out.logits]
        for t in range(5, 12):
            out = model(ids[:, t : t + 1], cache=cache)
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
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    with torch.no_grad():  # equal weights; a memory-mapped weight's alignment may change BLAS's summation order
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    assert type(loaded) is LinmemForCausalLM and loaded.config.layer_pattern == spec[0]


def test_loss_shifts_labels_ignores_minus_100_and_packed_boundaries():
    model = tiny("LL", "gated_deltanet", "softmax")
    ids = torch.randint(0, VOCAB, (1, 10))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(ids, labels=labels, use_cache=False, return_logits=True)
    manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    assert torch.allclose(out.loss, manual)
    cu = torch.tensor([0, 4, 10])
    packed = model(ids, labels=ids, cu_seqlens=cu, use_cache=False, return_logits=True)
    keep = torch.ones(9, dtype=torch.bool)
    keep[3] = False  # token 3 ends sequence 0 and must not predict token 4
    manual = torch.nn.functional.cross_entropy(packed.logits[0, :-1][keep], ids[0, 1:][keep])
    assert torch.allclose(packed.loss, manual)


def test_pure_memory_cache_has_constant_size():
    """The same cache bytes while decoding after a 4-token prompt as after a 4096-token one."""
    model = tiny("LL", "gated_deltanet", "softmax")
    sizes = []
    with torch.no_grad():
        for prompt in (4, 4096):
            out = model(torch.randint(0, VOCAB, (1, prompt)))
            cache = output_cache(out)
            for _ in range(5):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache)
                sizes.append(cache.nbytes())
    assert cache.get_seq_length() == 4096 + 5
    assert len(set(sizes)) == 1 and sizes[0] > 0, sizes


def test_generate_feeds_one_token_per_step_to_the_cache():
    model = tiny("LN", "gated_deltanet", "softmax")
    lengths = []
    forward = model.model.forward
    model.model.forward = lambda *a, **k: lengths.append(k["input_ids"].shape[1]) or forward(*a, **k)
    model.generate(torch.randint(1, VOCAB, (1, 5)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert lengths == [5, 1, 1, 1]


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
    """A recipe's ``params`` (and ``active_params``) are what the model has; its name's label is the
    paper's: within 25 % of the count (MoE labels leave out embeddings: 15 % total, 20 % active; MoM's label
    is the size of the same model with one memory per layer)."""
    recipe = MODEL_RECIPES[name]
    with torch.device("meta"):
        model = LinmemForCausalLM(recipe.build_config())
    total, active = model.num_all_parameters() / 1e6, model.num_active_parameters() / 1e6
    print(f"\n{name}: {total:.1f}M parameters, {active:.1f}M active (label {recipe.nominal_params}M)")
    assert recipe.params == round(total, 1)
    assert recipe.active_params == (round(active, 1) if recipe.nominal_active_params else None)
    if recipe.config.get("memory") == "mom":
        with torch.device("meta"):
            dense = LinmemForCausalLM(recipe.build_config(memory=recipe.config["mom"]["memory"]))
        total = dense.num_all_parameters() / 1e6
    if recipe.nominal_active_params is None:
        assert 0.8 * recipe.nominal_params <= total <= 1.25 * recipe.nominal_params
    else:
        body = model.num_all_parameters(exclude_embeddings=True) / 1e6
        active_body = model.num_active_parameters(exclude_embeddings=True) / 1e6
        assert abs(body / recipe.nominal_params - 1) < 0.15
        assert abs(active_body / recipe.nominal_active_params - 1) < 0.20


def test_cache_is_a_transformers_cache():
    from transformers.cache_utils import Cache

    cache = LinmemCache(3)
    assert isinstance(cache, Cache) and cache.get_seq_length() == 0 and len(cache) == 3


def saved_activation_bytes_and_gradients(model: LinmemForCausalLM, ids: torch.Tensor):
    """Loss, gradients and the bytes autograd keeps for the backward pass (outside checkpointed blocks)."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


def test_activation_checkpointing_gives_the_same_loss_and_gradients_with_less_memory():
    """Per block, from the config or transformers' gradient_checkpointing_enable(); the routers' losses
    (MoM, MoE) still reach their weights."""
    over = dict(mom=dict(memory="gla"), mlp="moe", moe=dict(num_experts=4, intermediate_size=32))
    ids = torch.randint(0, VOCAB, (2, 16))
    loss, grads, memory = saved_activation_bytes_and_gradients(tiny("LN", "mom", "softmax", **over).train(), ids)
    hf = tiny("LN", "mom", "softmax", **over).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        hf.gradient_checkpointing_enable()
    for model in (tiny("LN", "mom", "softmax", activation_checkpointing=True, **over).train(), hf):
        ckpt_loss, ckpt_grads, ckpt_memory = saved_activation_bytes_and_gradients(model, ids)
        torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        print(f"\nsaved for backward: {memory} bytes, with checkpointing {ckpt_memory} bytes")
        assert ckpt_memory < 0.5 * memory
    assert grads["model.layers.0.mixer.router.weight"].abs().sum() > 0


def test_eval_forward_of_packed_sequences_needs_no_use_cache_flag():
    model = tiny("LN", "gated_deltanet", "softmax")
    cu = torch.tensor([0, 3, 8])
    with torch.no_grad():
        out = model(torch.randint(0, VOCAB, (1, 8)), cu_seqlens=cu)
        assert output_cache(out) is None and out.logits.shape == (1, 8, VOCAB)
        with pytest.raises(ValueError, match="packed sequences .* keep no decoding cache"):
            model(torch.randint(0, VOCAB, (1, 8)), cu_seqlens=cu, use_cache=True)


def test_generate_and_eval_forwards_raise_no_deprecation(monkeypatch):
    """No warnings, and none of transformers' once-only log warnings (its cache-name deprecation)."""
    logged = []
    monkeypatch.setattr(logging.Logger, "warning_once", lambda self, msg, *a, **k: logged.append(str(msg)),
                        raising=False)
    model = tiny("LN", "gated_deltanet", "fox")
    ids = torch.randint(1, VOCAB, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = model(ids)
            model(ids[:, -1:], cache=output_cache(out), attention_mask=torch.ones(2, 6, dtype=torch.long))
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert not logged, logged


@pytest.mark.parametrize("ids,message", [
    (torch.zeros(1, 0, dtype=torch.long), r"`input_ids` must be a non-empty \[B, T\] tensor"),
    (torch.tensor([[3, VOCAB]]), rf"`input_ids` must lie in \[0, vocab_size = {VOCAB}\), got {VOCAB}"),
    (torch.tensor([[-1, 3]]), r"`input_ids` must lie in \[0, vocab_size = 64\), got -1"),
    (torch.ones(1, 3), r"`input_ids` must hold integer token ids"),
], ids=["empty", "above-vocab", "negative", "float"])
def test_bad_input_ids_are_named_errors(ids, message):
    model = tiny("LN", "gated_deltanet", "softmax")
    with pytest.raises(ValueError, match=message):
        model(ids)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, max_new_tokens=2, pad_token_id=0)


def test_import_linmem_registers_with_transformers_once_autoconfig_is_imported(tmp_path, monkeypatch):
    """The hook runs its callback after the watched module has run, and only once."""
    import sys

    import linmem

    (tmp_path / "watched_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = linmem._AfterImport("watched_module", lambda: seen.append(sys.modules["watched_module"].VALUE))
    sys.meta_path.insert(0, hook)
    try:
        import watched_module  # noqa: F401
    finally:
        sys.modules.pop("watched_module", None)
    assert seen == [42] and hook not in sys.meta_path
    assert AutoConfig.for_model("linmem", **dict(vocab_size=VOCAB, hidden_size=32, num_heads=2)).model_type == "linmem"
    assert {"LinmemForCausalLM", "LinmemConfig", "LinmemModel", "LinmemCache", "linear_recurrence"} <= set(dir(linmem))
    assert linmem.LinmemForCausalLM is LinmemForCausalLM
