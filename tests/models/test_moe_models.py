"""Models with mixtures of memories and of experts: decoding, padding and packing invariants, save ->
load, the routers' losses inside `loss`, router logits on request, config validation, the trainer's
router metrics, and the parameter counts of the Linear-MoE recipes (total and active, meta device)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from linmem.models import MODEL_RECIPES, LinmemConfig, LinmemForCausalLM
from linmem.models.modeling import causal_lm_loss
from linmem.train import Trainer, load_config

VOCAB = 64
MODELS = {
    "moe": dict(layer_pattern="LN", mlp="moe", num_experts=4, num_experts_per_tok=2, num_shared_experts=1),
    "mom-gla": dict(layer_pattern="LL", memory="mom", mom_memory="gla", use_short_conv=True),
    "mom-mamba2+moe-sigmoid": dict(layer_pattern="LNL", memory="mom", mom_memory="mamba2", mlp="moe",
                                   num_experts=4, moe_router="sigmoid", num_memories=3, mom_top_k=1),
}


def tiny(**over) -> LinmemForCausalLM:
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, intermediate_size=64,
                          moe_intermediate_size=32, **over)
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
        logits = [out.logits] + [model(ids[:, t: t + 1], past_key_values=out.past_key_values).logits
                                 for t in range(4, 10)]
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
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.mom_top_k == 1 and loaded.config.moe_router == "sigmoid"


def test_aux_loss_is_inside_the_loss_with_its_coefficients():
    model = tiny(**MODELS["mom-mamba2+moe-sigmoid"], mom_aux_loss_coef=0.1, router_aux_loss_coef=0.2,
                 router_z_loss_coef=0.3)
    ids = torch.randint(0, VOCAB, (2, 9))
    out = model(ids, labels=ids, use_cache=False)
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

    plain = tiny(**MODELS["moe"], router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    out = plain(ids, labels=ids, use_cache=False)
    assert float(out.aux_loss.detach()) == 0.0 and torch.equal(out.loss, causal_lm_loss(out.logits, ids))


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
    (dict(memory="mom", mom_memory="lstm"), "valid: deltanet, gated_deltanet"),
    (dict(num_memories=2, mom_top_k=3), r"mom_top_k = 3 must lie in \[1, num_memories = 2\]"),
    (dict(mlp="moe", num_experts=4, num_experts_per_tok=6), r"num_experts_per_tok = 6 must lie in \[1, num_experts"),
    (dict(moe_router="relu"), "valid: softmax, sigmoid"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef must be >= 0"),
])
def test_config_refuses_invalid_routing_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        LinmemConfig(**fields)


def test_trainer_logs_the_aux_loss_and_the_load(tmp_path):
    config = load_config(overrides=[
        "data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=32",
        "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=LN",
        "model.memory=mom", "model.options.mlp=moe", "model.options.num_experts=4",
        "model.options.moe_intermediate_size=16", "schedule.steps=2", "schedule.warmup_steps=1",
        "run.save_every=0", "run.log_every=1", "run.progress=false", "run.tensorboard=false",
        f"run.out_dir={tmp_path}",
    ])
    Trainer(config).train()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {"aux_loss", "moe_load_max", "moe_load_min", "mom_load_max", "mom_load_min"} <= set(first)
    assert first["aux_loss"] > 0 and first["moe_load_min"] <= 1.0 <= first["moe_load_max"]


LINEAR_MOE = [name for name in MODEL_RECIPES if name.startswith("linear-moe")]


@pytest.mark.parametrize("name", LINEAR_MOE)
def test_linear_moe_recipes_have_the_papers_total_and_active_sizes(name):
    """The names are rounded labels without the embeddings. Without them A0.3B-2B counts 2.18B total /
    0.33B active (with our 32000-token untied embeddings 2.24B / 0.39B) and A1B-7B 6.78B / 1.14B
    (6.91B / 1.28B): the experts give 2.11B / 0.26B and 6.44B / 0.81B, the memory layers the rest
    (Gated DeltaNet: ~5 D^2 per layer, 0.06B and 0.34B), which the labels round away; a hybrid's
    attention layers (4 D^2) make it slightly smaller. Tolerance: 15 % total, 20 % active."""
    recipe = MODEL_RECIPES[name]
    with torch.device("meta"):
        model = LinmemForCausalLM(recipe.build_config())
    total, active = model.num_all_parameters() / 1e6, model.num_active_parameters() / 1e6
    total_body = model.num_all_parameters(exclude_embeddings=True) / 1e6
    active_body = model.num_active_parameters(exclude_embeddings=True) / 1e6
    print(f"\n{name}: total {total:.0f}M, active {active:.0f}M; without embeddings {total_body:.0f}M / "
          f"{active_body:.0f}M (nominal {recipe.nominal_params:.0f}M / {recipe.nominal_active_params:.0f}M)")
    assert abs(total_body / recipe.nominal_params - 1) < 0.15
    assert abs(active_body / recipe.nominal_active_params - 1) < 0.20
