"""MQAR on a shared key/value vocabulary, Update-MQAR and Block-MQAR: layout, labels, determinism, validation."""

import numpy as np
import pytest
import torch

from linmem.data.mqar import IGNORE_INDEX
from linmem.data.mqar_variants import generate_block_mqar, generate_shared_mqar, generate_update_mqar


def _queries(inputs, labels):
    """Per example: [(position, queried token, label)]."""
    return [[(int(t), int(inputs[n, t]), int(labels[n, t])) for t in (labels[n] != IGNORE_INDEX).nonzero()[:, 0]]
            for n in range(inputs.shape[0])]


def _distinct(x):
    ordered = x.sort(dim=1).values
    return bool((ordered[:, 1:] != ordered[:, :-1]).all())


def test_shared_vocabulary_layout():
    N, L, K, V = 300, 64, 8, 40
    inputs, labels = generate_shared_mqar(N, L, K, V, seed=0)
    keys, values = inputs[:, 0:2 * K:2], inputs[:, 1:2 * K:2]
    assert _distinct(torch.cat([keys, values], 1)) and keys.min() >= 1 and values.max() < V
    assert (keys >= V // 2).any() and (values < V // 2).any(), "keys and values share one pool"
    assert not (labels[:, :2 * K] != IGNORE_INDEX).any()
    for n, found in enumerate(_queries(inputs, labels)):
        assert len(found) == K
        binding = dict(zip(keys[n].tolist(), values[n].tolist()))
        assert all((t - 2 * K) % 2 == 0 and binding[key] == label for t, key, label in found)


def test_update_mqar_recalls_the_latest_binding():
    N, L, K, U, V = 200, 64, 6, 3, 64
    inputs, labels = generate_update_mqar(N, L, K, V, num_updates=U, seed=1)
    keys, values = inputs[:, 0:2 * K:2], inputs[:, 1:2 * K:2]
    rebound, fresh = inputs[:, 2 * K:2 * K + 2 * U:2], inputs[:, 2 * K + 1:2 * K + 2 * U:2]
    assert _distinct(torch.cat([keys, values, fresh], 1)) and _distinct(rebound)
    assert labels[:, :2 * K + 2 * U].eq(IGNORE_INDEX).all()
    for n, found in enumerate(_queries(inputs, labels)):
        latest = dict(zip(keys[n].tolist(), values[n].tolist()))
        assert set(rebound[n].tolist()) <= set(latest)
        latest.update(zip(rebound[n].tolist(), fresh[n].tolist()))
        assert sorted(key for _, key, _ in found) == sorted(latest)
        assert all(latest[key] == label for _, key, label in found)
    first_rebound = (rebound[:, :1] == keys).float().argmax(1)
    assert len(set(first_rebound.tolist())) == K, "every key gets rebound in some example"


def test_block_mqar_each_block_its_own_bindings():
    N, L, K, B, V = 100, 96, 4, 3, 24
    inputs, labels = generate_block_mqar(N, L, K, V, num_blocks=B, seed=2)
    block = L // B
    recurring = 0
    for n, found in enumerate(_queries(inputs, labels)):
        assert len(found) == B * K
        bindings = []
        for b in range(B):
            part = inputs[n, b * block:(b + 1) * block]
            bindings.append(dict(zip(part[0:2 * K:2].tolist(), part[1:2 * K:2].tolist())))
        for t, key, label in found:
            b, offset = divmod(t, block)
            assert offset >= 2 * K and (offset - 2 * K) % 2 == 0 and bindings[b][key] == label
        recurring += bool(set(bindings[0]) & set(bindings[1]))
    assert recurring > 0, "keys recur across blocks"


@pytest.mark.parametrize("make", [
    lambda seed: generate_shared_mqar(4, 32, 4, 50, seed=seed),
    lambda seed: generate_update_mqar(4, 32, 4, 50, num_updates=2, seed=seed),
    lambda seed: generate_block_mqar(4, 64, 4, 50, num_blocks=2, seed=seed),
])
def test_seeded(make):
    a, b, c = make(5), make(5), make(6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_without_random_non_queries_fillers_are_zero():
    inputs, labels = generate_update_mqar(3, 40, 4, 30, num_updates=1, random_non_queries=False, seed=0)
    tail = inputs[:, 10:]
    assert np.array_equal((tail != 0).numpy(), (labels[:, 10:] != IGNORE_INDEX).numpy())


@pytest.mark.parametrize("call,words", [
    (lambda: generate_shared_mqar(1, 30, 8, 64, seed=0), "seq_len must be >= 32"),
    (lambda: generate_shared_mqar(1, 31, 4, 64, seed=0), "seq_len must be even"),
    (lambda: generate_shared_mqar(1, 64, 8, 16, seed=0), "need vocab_size >= 17"),
    (lambda: generate_update_mqar(1, 64, 4, 64, num_updates=5, seed=0), "num_updates must be in"),
    (lambda: generate_update_mqar(1, 18, 4, 64, num_updates=2, seed=0), "seq_len must be >= 20"),
    (lambda: generate_block_mqar(1, 60, 4, 64, num_blocks=7, seed=0), "divide seq_len"),
    (lambda: generate_block_mqar(1, 24, 4, 64, num_blocks=2, seed=0), r"seq_len / num_blocks must be >= 16"),
])
def test_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()
