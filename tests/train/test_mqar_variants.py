"""MQAR variants as training tasks (``data.mqar.variant``): the default is Zoology's MQAR as before; Update-MQAR is
scored on the latest binding of every key (a memory that keeps the latest value scores 1, one that keeps the first
scores the share of keys never rebound); a bad variant is refused by name; the Update-MQAR and Block-MQAR recipes
compare the Bayesian memory, Gated DeltaNet and Mamba-2 at one width, the same model and data but the memory, and
each trains."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from linmem.data.mqar import generate_mqar
from linmem.data.mqar_variants import mqar_generator, rebound_pairs
from linmem.train import ConfigError, Trainer, load_config
from linmem.train.tasks import EVAL_SEED_OFFSET, MQARTask

VOCAB = 64


def section(*extra: str):
    return load_config(overrides=[f"data.mqar.vocab_size={VOCAB}", "data.mqar.settings=[[32, 4]]",
                                  "data.mqar.train_examples=16", "data.mqar.eval_examples=16", "data.batch_size=8",
                                  *extra]).data


class Recall(torch.nn.Module):
    """A perfect memory of the pairs in the first ``prefix`` positions: at every later position it predicts the
    value bound to the token there, the latest binding (``latest``) or the first."""

    def __init__(self, prefix: int, latest: bool) -> None:
        super().__init__()
        self.prefix, self.latest = prefix, latest

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        N, L = input_ids.shape
        logits = torch.zeros(N, L, VOCAB)
        for n, row in enumerate(input_ids.tolist()):
            memory: dict[int, int] = {}
            for key, value in zip(row[0:self.prefix:2], row[1:self.prefix:2]):
                if self.latest or key not in memory:
                    memory[key] = value
            for t in range(self.prefix, L):
                if row[t] in memory:
                    logits[n, t, memory[row[t]]] = 1.0
        return SimpleNamespace(logits=logits)


def test_update_mqar_is_scored_on_the_latest_binding():
    task = MQARTask(section("data.mqar.variant=update", "data.mqar.update_fraction=0.5"))
    K, U = 4, rebound_pairs(4, 0.5)
    prefix = 2 * K + 2 * U
    assert task.evaluate(Recall(prefix, latest=True), torch.device("cpu")) == {"mqar_acc/L32_kv4": 1.0}
    assert task.evaluate(Recall(prefix, latest=False), torch.device("cpu")) == {"mqar_acc/L32_kv4": 1 - U / K}


def test_the_default_variant_is_zoology_mqar():
    task = MQARTask(section())
    x, y = task.eval_sets[(32, 4)]
    expected_x, expected_y = generate_mqar(16, 32, 4, VOCAB, seed=EVAL_SEED_OFFSET)
    assert torch.equal(x, expected_x) and torch.equal(y, expected_y)


@pytest.mark.parametrize("variant", ["shared", "block"])
def test_every_variant_builds_a_task(variant):
    task = MQARTask(section(f"data.mqar.variant={variant}"))
    x, y = task.eval_sets[(32, 4)]
    assert x.shape == y.shape == (16, 32) and int((y != -100).sum()) == 16 * 4 * (2 if variant == "block" else 1)
    assert int(x[:, 0].min()) >= 1 and int(x.max()) < VOCAB  # keys from the shared pool [1, V)


def test_a_bad_variant_is_refused_by_name():
    with pytest.raises(ConfigError, match="data.mqar.variant must be base, shared, update or block, got 'updates'"):
        section("data.mqar.variant=updates")
    with pytest.raises(ValueError, match="unknown MQAR variant 'x'; valid: base, shared, update, block"):
        mqar_generator("x")


MEMORIES = ("bayes", "gated_deltanet", "mamba2")
RECALL_RECIPES = [f"{task}-mqar-{memory}" for task in ("update", "block") for memory in MEMORIES]


@pytest.mark.parametrize("task", ["update", "block"])
def test_the_recall_recipes_of_a_task_differ_only_in_the_memory(task):
    configs = {memory: load_config(recipe=f"{task}-mqar-{memory}") for memory in MEMORIES}
    assert {memory: c.model.memory for memory, c in configs.items()} == {m: m for m in MEMORIES}
    gdn = configs["gated_deltanet"]
    for memory, config in configs.items():
        assert config.run.out_dir == f"runs/{task}-mqar-{memory}"
        config.model.memory, config.run.out_dir = gdn.model.memory, gdn.run.out_dir
        assert config == gdn
    m = gdn.data.mqar
    assert m.variant == task
    generate = mqar_generator(m.variant, update_fraction=m.update_fraction, num_blocks=m.num_blocks)
    blocks = m.num_blocks if task == "block" else 1
    for seq_len, kv in m.settings + m.eval_settings:  # every setting fits the recipe's pool
        inputs, labels = generate(1, seq_len, kv, m.vocab_size, power_a=m.power_a, seed=0)
        assert int((labels != -100).sum()) == kv * blocks and int(inputs.max()) < m.vocab_size
    (trained, _), (longest, _) = m.eval_settings[0], m.eval_settings[-1]
    assert longest == 2 * trained == 2 * max(seq_len for seq_len, _ in m.settings)  # the trained length and 2x


def test_the_block_recipes_are_the_update_recipes_on_the_block_variant():
    update, block = load_config(recipe="update-mqar-bayes"), load_config(recipe="block-mqar-bayes")
    block.data.mqar.variant, block.data.mqar.num_blocks = update.data.mqar.variant, update.data.mqar.num_blocks
    block.run.out_dir = update.run.out_dir
    assert block == update


@pytest.mark.parametrize("name", RECALL_RECIPES)
def test_every_recall_recipe_trains_a_few_steps(name, tmp_path):
    config = load_config(recipe=name, overrides=[
        "data.mqar.train_examples=16", "data.mqar.eval_examples=4", "data.batch_size=4", "schedule.steps=2",
        "schedule.warmup_steps=1", "run.device=cpu", "run.progress=false", "run.tensorboard=false",
        "run.save_every=0", "run.eval_every=0", f"run.out_dir={tmp_path / 'run'}"])
    result = Trainer(config).train()
    assert sorted(result.losses) == [1, 2] and all(math.isfinite(loss) for loss in result.losses.values())
    assert set(result.metrics) == {f"mqar_acc/L{L}_kv{kv}" for L, kv in config.data.mqar.eval_settings}
