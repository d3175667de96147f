"""The Linear-MoE training recipes: Table 2's schedule as loaded by name, and each trains a few steps on CPU at a
shrunk width (overrides) on a tiny byte-level corpus; so do MoM's model recipes."""

from __future__ import annotations

import math

import pytest

from linmem.models import MODEL_RECIPES
from linmem.train import Trainer, load_config

LINEAR_MOE = ["linear-moe-a0.3b-2b", "linear-moe-a0.3b-2b-hybrid", "linear-moe-a1b-7b", "linear-moe-a1b-7b-hybrid"]


@pytest.mark.parametrize("name", LINEAR_MOE)
def test_linear_moe_recipe_has_the_papers_schedule(name):
    config = load_config(recipe=name)
    assert config.model.recipe == name and name in MODEL_RECIPES
    assert config.optim.lr == 1e-4 and math.isclose(config.optim.lr * config.schedule.min_lr_ratio, 1e-5)
    assert config.data.max_document_tokens == 2048
    assert config.data.tokens_per_batch * config.schedule.grad_accum == 2 ** 19  # 0.5M tokens per step


def tiny_corpus(folder):
    corpus = folder / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 4)
    return corpus


@pytest.mark.parametrize("name", LINEAR_MOE)
def test_linear_moe_recipe_trains_at_a_shrunk_width(name, tmp_path):
    corpus = tiny_corpus(tmp_path)
    pattern = "LN" if name.endswith("hybrid") else "LL"
    config = load_config(recipe=name, overrides=[
        "data.text.dataset=null", "data.text.tokenizer=null", f"data.text.paths=[{str(corpus)!r}]",
        "data.text.val_fraction=0.2", "data.tokens_per_batch=128", "data.max_document_tokens=64",
        "model.options.hidden_size=32", "model.options.num_heads=2", f"model.options.layer_pattern={pattern}",
        "model.options.moe.num_experts=4", "model.options.moe.num_experts_per_tok=2",
        "model.options.moe.intermediate_size=16", "schedule.steps=2", "schedule.warmup_steps=1",
        "schedule.grad_accum=2", "run.progress=false", "run.tensorboard=false", "run.save_every=0",
        "run.eval_every=0", f"run.out_dir={tmp_path / 'run'}",
    ])
    trainer = Trainer(config)
    result = trainer.train()
    assert sorted(result.losses) == [1, 2] and all(math.isfinite(loss) for loss in result.losses.values())
    assert trainer.model.config.moe["num_experts"] == 4 and trainer.model.config.layer_pattern == pattern


@pytest.mark.parametrize("name", ["mom-340m", "mom-1.3b", "mom-340m-hybrid", "mom-1.3b-hybrid"])
def test_mom_model_recipe_trains_at_a_shrunk_width(name, tmp_path):
    corpus = tiny_corpus(tmp_path)
    pattern = "LN" if name.endswith("hybrid") else "LL"
    config = load_config(overrides=[
        f"model.recipe={name}", "data.task=text", f"data.text.paths=[{str(corpus)!r}]", "data.text.val_fraction=0.2",
        "data.tokens_per_batch=128", "data.max_document_tokens=64", "model.options.hidden_size=32",
        "model.options.num_heads=2", f"model.options.layer_pattern={pattern}", "schedule.steps=2",
        "schedule.warmup_steps=1", "run.progress=false", "run.tensorboard=false", "run.save_every=0",
        "run.eval_every=0", f"run.out_dir={tmp_path / 'run'}",
    ])
    trainer = Trainer(config)
    result = trainer.train()
    assert sorted(result.losses) == [1, 2] and all(math.isfinite(loss) for loss in result.losses.values())
    assert trainer.model.config.mom == {**MODEL_RECIPES[name].config["mom"], "aux_loss_coef":
                                        trainer.model.config.mom["aux_loss_coef"]}
