"""MQAR variants as training tasks (``data.mqar.variant``): the default is Zoology's MQAR as before; Update-MQAR is
scored on the latest binding of every key (a memory that keeps the latest value scores 1, one that keeps the first
scores the share of keys never rebound); a bad variant is refused by name; the Update-MQAR recipes compare the
Bayesian memory with Gated DeltaNet at one width."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from linmem.data.mqar import generate_mqar
from linmem.data.mqar_variants import mqar_generator, rebound_pairs
from linmem.train import ConfigError, load_config
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


def test_the_update_mqar_recipes_differ_only_in_the_memory():
    bayes, gdn = (load_config(recipe=f"update-mqar-{memory}") for memory in ("bayes", "gated_deltanet"))
    assert (bayes.model.memory, gdn.model.memory) == ("bayes", "gated_deltanet")
    bayes.model.memory, bayes.run.out_dir = gdn.model.memory, gdn.run.out_dir
    assert bayes == gdn
    m = gdn.data.mqar
    assert m.variant == "update"
    generate = mqar_generator(m.variant, update_fraction=m.update_fraction)
    for seq_len, kv in m.settings + m.eval_settings:  # every setting fits the recipe's pool
        inputs, labels = generate(1, seq_len, kv, m.vocab_size, power_a=m.power_a, seed=0)
        assert int((labels != -100).sum()) == kv and int(inputs.max()) < m.vocab_size
