"""Models with mixtures of memories and of experts: decoding, padding and packing invariants, save ->
load, the routers' losses inside `loss`, router logits on request, config validation, the trainer's
router metrics. (The Linear-MoE recipes' counts are checked with every recipe in test_model.py.)"""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.models.config import merge_fields
from linmem.models.modeling import causal_lm_loss
from linmem.models.outputs import output_cache
from linmem.train import Trainer, load_config
from linmem.train.metrics import read_metrics

VOCAB = 64
MODELS = {
    "moe": dict(layer_pattern="LN", mlp="moe", moe=dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1)),
    "mom-gla": dict(layer_pattern="LL", memory="mom", mom=dict(memory="gla"), mixer=dict(use_short_conv=True)),
    "mom-mamba2+moe-sigmoid": dict(layer_pattern="LNL", memory="mom", mlp="moe",
                                   mom=dict(memory="mamba2", num_memories=3, top_k=1),
                                   moe=dict(num_experts=4, router="sigmoid")),
}


def tiny(**over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(**merge_fields(dict(vocab_size=VOCAB, hidden_size=32, num_heads=2, intermediate_size=64,
                                              moe=dict(intermediate_size=32)), over))
    return LinmemForCausalLM(config).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(MODELS))
def test_decoding_padding_and_packing_equal_the_forward(name):
    model = tiny(**MODELS[name])
    ids = torch.randint(1, VOCAB, (2, 10))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :4])
        logits = [out.logits] + [model(ids[:, t: t + 1], cache=output_cache(out)).logits for t in range(4, 10)]
        assert rel(torch.cat(logits, 1), full) < 1e-4, "prefill + decode"

        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:1]], 1)
        mask = torch.ones_like(padded)
        mask[0, :3] = 0
        assert rel(model(padded, attention_mask=mask, use_cache=False).logits[:, 3:], full[:1]) < 1e-4, "padding"

        cu = torch.tensor([0, 10, 16], dtype=torch.int32)
        packed = model(torch.cat([ids[:1], ids[1:, :6]], 1), cu_seqlens=cu, use_cache=False).logits
        assert rel(packed[:, :10], full[:1]) < 1e-4, "packed"
        assert rel(packed[:, 10:], model(ids[1:, :6], use_cache=False).logits) < 1e-4, "packed"


def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny(**MODELS["mom-mamba2+moe-sigmoid"])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    with torch.no_grad():  # equal weights; a memory-mapped weight's alignment may change BLAS's summation order
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    assert loaded.config.mom["top_k"] == 1 and loaded.config.moe["router"] == "sigmoid"


def test_aux_loss_is_inside_the_loss_with_its_coefficients():
    model = tiny(**merge_fields(MODELS["mom-mamba2+moe-sigmoid"],
                                dict(mom=dict(aux_loss_coef=0.1), moe=dict(aux_loss_coef=0.2, z_loss_coef=0.3))))
    ids = torch.randint(0, VOCAB, (2, 9))
    out = model(ids, labels=ids, use_cache=False, return_logits=True)
    stats = out.router_stats
    assert [s.kind for s in stats] == ["mom", "moe", "moe", "mom", "moe"]  # layer order: mixer, then MLP
    mom, moe = [s for s in stats if s.kind == "mom"], [s for s in stats if s.kind == "moe"]
    expected = (0.1 * sum(s.balance_loss for s in mom) / 2 + 0.2 * sum(s.balance_loss for s in moe) / 3
                + 0.3 * sum(s.z_loss for s in moe) / 3)
    torch.testing.assert_close(out.aux_loss, expected)
    torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, ids) + expected)
    out.loss.backward()
    assert model.model.layers[0].mixer.router.weight.grad.abs().sum() > 0
    assert model.model.layers[1].mlp.router.weight.grad.abs().sum() > 0

    plain = tiny(**merge_fields(MODELS["moe"], dict(moe=dict(aux_loss_coef=0.0, z_loss_coef=0.0))))
    out = plain(ids, labels=ids, use_cache=False, return_logits=True)
    assert float(out.aux_loss.detach()) == 0.0
    torch.testing.assert_close(out.loss, causal_lm_loss(out.logits, ids))


def test_router_logits_are_returned_on_request():
    model = tiny(**MODELS["moe"])
    ids = torch.randint(0, VOCAB, (2, 5))
    assert model(ids, use_cache=False).router_logits is None
    logits = model(ids, use_cache=False, output_router_logits=True).router_logits
    assert [tuple(t.shape) for t in logits] == [(10, 4), (10, 4)]
    assert tiny(**MODELS["moe"], output_router_logits=True)(ids, use_cache=False).router_logits is not None
    assert tiny(layer_pattern="LN")(ids, use_cache=False).aux_loss is None  # no routed layer, no aux loss


@pytest.mark.parametrize("fields,message", [
    (dict(mlp="dense"), "valid: swiglu, moe"),
    (dict(memory="mom", mom=dict(memory="lstm")), "valid: bayes, deltanet, gated_deltanet"),
    (dict(mom=dict(num_memories=2, top_k=3)), r"`mom.top_k` = 3 must lie in \[1, num_memories = 2\]"),
    (dict(mlp="moe", moe=dict(num_experts=4, num_experts_per_tok=6)),
     r"`moe.num_experts_per_tok` = 6 must lie in \[1, num_experts"),
    (dict(moe=dict(router="relu")), "valid: softmax, sigmoid"),
    (dict(moe=dict(aux_loss_coef=-1.0)), "`moe.aux_loss_coef` must be a finite number >= 0"),
    (dict(mom=dict(aux_loss_coef=-1.0)), "`mom.aux_loss_coef` must be a finite number >= 0"),
])
def test_config_refuses_invalid_routing_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        LinmemConfig(**fields)


def test_trainer_logs_the_aux_loss_and_the_load(tmp_path):
    config = load_config(overrides=[
        "data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=32",
        "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=LN",
        "model.memory=mom", "model.options.mlp=moe", "model.options.moe.num_experts=4",
        "model.options.moe.intermediate_size=16", "schedule.steps=2", "schedule.warmup_steps=1",
        "run.save_every=0", "run.log_every=1", "run.progress=false", "run.tensorboard=false",
        f"run.out_dir={tmp_path}",
    ])
    Trainer(config).train()
    first = next(row for row in read_metrics(tmp_path / "metrics.jsonl") if "loss" in row)
    assert {"aux_loss", "moe_load_max", "moe_load_min", "mom_load_max", "mom_load_min"} <= set(first)
    assert first["aux_loss"] > 0 and first["moe_load_min"] <= 1.0 <= first["moe_load_max"]
