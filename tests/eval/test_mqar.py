"""MQAR as Zoology defines it: layout, labels, determinism, power-law gaps, metric, validation."""

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from linmem.data.mqar import IGNORE_INDEX, MQAR_GRID, generate_mqar, mqar_accuracy, shift_labels_right


def _context(inputs, num_kv_pairs):
    context = inputs[:, :2 * num_kv_pairs]
    return context[:, 0::2], context[:, 1::2]


def _gaps_by_key(inputs, labels, num_kv_pairs):
    """[N, K] gap index of each context key, read back from where it is queried."""
    keys, _ = _context(inputs, num_kv_pairs)
    rows, positions = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
    slot = (inputs[rows, positions][:, None] == keys[rows]).float().argmax(dim=1)
    gaps = torch.empty_like(keys)
    gaps[rows, slot] = (positions - 2 * num_kv_pairs) // 2
    return gaps


@pytest.mark.parametrize("seq_len,num_kv_pairs,vocab_size", [(64, 8, 64), (128, 8, 8192), (64, 16, 40)])
def test_keys_and_values_ranges_distinct(seq_len, num_kv_pairs, vocab_size):
    inputs, _ = generate_mqar(400, seq_len, num_kv_pairs, vocab_size, seed=1)
    keys, values = _context(inputs, num_kv_pairs)
    half = vocab_size // 2
    assert keys.min() >= 1 and keys.max() < half
    assert values.min() >= half and values.max() < vocab_size
    for tokens in (keys, values):
        ordered = tokens.sort(dim=1).values
        assert (ordered[:, 1:] != ordered[:, :-1]).all(), "a key or value repeats within an example"


def test_key_and_value_marginals_uniform():
    """Small ranges: each key (value) token equally likely in every context slot."""
    inputs, _ = generate_mqar(20_000, 16, 4, 12, seed=2)  # keys from [1, 6), values from [6, 12)
    keys, values = _context(inputs, 4)
    for tokens, low, count in ((keys, 1, 5), (values, 6, 6)):
        freq = F.one_hot(tokens - low, count).float().mean(dim=0)  # [K slots, count]
        assert torch.allclose(freq, torch.full_like(freq, 1 / count), atol=0.02), freq


@pytest.mark.parametrize("random_non_queries", [True, False])
def test_labels_only_at_queries_with_paired_values(random_non_queries):
    N, L, K, V = 300, 128, 8, 256
    inputs, labels = generate_mqar(N, L, K, V, seed=3, random_non_queries=random_non_queries)
    keys, values = _context(inputs, K)
    labelled = labels != IGNORE_INDEX
    assert (labelled.sum(dim=1) == K).all()
    assert not labelled[:, :2 * K].any(), "labels inside the context"
    rows, positions = labelled.nonzero(as_tuple=True)
    assert ((positions - 2 * K) % 2 == 0).all(), "queries sit on even offsets after the context"
    queried = inputs[rows, positions]
    match = queried[:, None] == keys[rows]  # [queries, K]
    assert (match.sum(dim=1) == 1).all(), "query token is not one of the example's keys"
    slot = match.float().argmax(dim=1)
    assert torch.equal(labels[rows, positions], values[rows, slot]), "label is not the value paired with the key"
    per_example = torch.zeros(N, K, dtype=torch.long).index_put_((rows, slot), torch.ones_like(slot), accumulate=True)
    assert (per_example == 1).all(), "every key must be queried exactly once"


def test_non_query_positions():
    N, L, K, V = 200, 64, 4, 8192
    noisy, labels = generate_mqar(N, L, K, V, seed=4)
    clean, clean_labels = generate_mqar(N, L, K, V, seed=4, random_non_queries=False)
    filler = (labels == IGNORE_INDEX)
    filler[:, :2 * K] = False
    assert (clean[filler] == 0).all()
    assert noisy[filler].min() >= 0 and noisy[filler].max() < V
    assert noisy[filler].float().std() > V / 5, "non-query tokens should be spread over the vocabulary"
    assert torch.equal(labels, clean_labels) and torch.equal(noisy[~filler], clean[~filler])


def test_deterministic_by_seed():
    a = generate_mqar(50, 64, 4, 8192, seed=7)
    b = generate_mqar(50, 64, 4, 8192, seed=7)
    c = generate_mqar(50, 64, 4, 8192, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert a[0].dtype == a[1].dtype == torch.int64


def _power_law(space, power_a=0.01):
    p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def test_first_gap_follows_power_law():
    N, L, K = 20_000, 64, 4
    inputs, labels = generate_mqar(N, L, K, 8192, seed=5, random_non_queries=False)
    gaps = _gaps_by_key(inputs, labels, K)
    space = (L - 2 * K) // 2
    p = _power_law(space)
    freq = np.bincount(gaps[:, 0].numpy(), minlength=space) / N
    sigma = np.sqrt(p * (1 - p) / N)
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-4), (freq, p)
    all_gaps = gaps.flatten().numpy()
    assert (all_gaps < space // 4).mean() > 0.45, "gaps should be biased towards short ones"
    assert 0 <= all_gaps.min() and all_gaps.max() < space


def test_gaps_drawn_successively_without_replacement():
    """K=2, 5 gap slots: P(g1=i, g2=j) = p_i p_j / (1 - p_i), as np.random.choice(replace=False, p=p)."""
    N = 40_000
    inputs, labels = generate_mqar(N, 14, 2, 16, seed=6, random_non_queries=False)
    gaps = _gaps_by_key(inputs, labels, 2).numpy()
    p = _power_law(5)
    expected = p[:, None] * p[None, :] / (1 - p[:, None])
    np.fill_diagonal(expected, 0)
    table = np.zeros((5, 5))
    np.add.at(table, (gaps[:, 0], gaps[:, 1]), 1 / N)
    sigma = np.sqrt(expected * (1 - expected) / N)
    assert np.all(np.abs(table - expected) < 5 * sigma + 1e-4), (table, expected)


def test_accuracy_metric():
    _, labels = generate_mqar(8, 64, 4, 64, seed=0)
    perfect = F.one_hot(labels.clamp_min(0), 64).float()
    assert mqar_accuracy(perfect, labels) == 1.0
    wrong_half = perfect.clone()
    rows, positions = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
    flip = torch.arange(len(rows)) % 2 == 0
    wrong_half[rows[flip], positions[flip]] = F.one_hot((labels[rows[flip], positions[flip]] + 1) % 64, 64).float()
    assert mqar_accuracy(wrong_half, labels) == pytest.approx(0.5)
    uniform_wrong = torch.zeros(8, 64, 64)
    uniform_wrong[..., 0] = 1  # predicts token 0, never a value
    assert mqar_accuracy(uniform_wrong, labels) == 0.0
    with pytest.raises(ValueError, match="logits"):
        mqar_accuracy(perfect[:, :-1], labels)
    with pytest.raises(ValueError, match="no position"):
        mqar_accuracy(perfect, torch.full_like(labels, IGNORE_INDEX))


def test_shift_labels_right_matches_causal_lm_loss():
    inputs, labels = generate_mqar(4, 64, 4, 64, seed=9)
    logits = torch.randn(4, 64, 64)
    aligned = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    shifted = shift_labels_right(labels)
    inside_shift = F.cross_entropy(logits[:, :-1].flatten(0, 1), shifted[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    assert torch.allclose(aligned, inside_shift)
    last = torch.full((1, 3), IGNORE_INDEX)
    last[0, -1] = 5
    with pytest.raises(ValueError, match="last position"):
        shift_labels_right(last)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=64, num_kv_pairs=17, vocab_size=8192), "does not fit in seq_len"),
    (dict(seq_len=64, num_kv_pairs=8, vocab_size=16), "key range"),
    (dict(seq_len=63, num_kv_pairs=4, vocab_size=8192), "even"),
    (dict(seq_len=64, num_kv_pairs=0, vocab_size=8192), "num_kv_pairs"),
])
def test_rejects_settings_that_do_not_fit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_mqar(4, seed=0, **kwargs)


def test_grid_settings_generate_quickly():
    for seq_len, num_kv_pairs in MQAR_GRID:
        inputs, labels = generate_mqar(16, seq_len, num_kv_pairs, 8192, seed=0)
        assert inputs.shape == labels.shape == (16, seq_len)
    start = time.perf_counter()
    generate_mqar(20_000, 512, 64, 8192, seed=0)
    assert time.perf_counter() - start < 4.0, "generation must be vectorised"
