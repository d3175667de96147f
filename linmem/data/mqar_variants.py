"""MQAR with a shared key/value vocabulary, and two variants that make a memory overwrite: Update-MQAR
and Block-MQAR (the recall tasks of the Bayesian-memory studies, Memory by Design, arXiv 2605.31163).

Conventions as in :mod:`linmem.data.mqar`: inputs and aligned labels ``[N, L]`` (``labels[t]`` is the
target of the prediction at position t, -100 elsewhere), deterministic given ``seed`` (a numpy
``Generator``), query positions drawn by the same power law. What changes is the vocabulary: keys and
values come from one pool ``[1, V)`` (0 is the filler token), so a token's role (key or value) is known
only from its position, and a token that is a key in one example can be a value in another.

* :func:`generate_shared_mqar`: MQAR on the shared vocabulary (2K distinct tokens per example).
* :func:`generate_update_mqar`: after the K pairs, ``num_updates`` of the keys are bound again to fresh
  values; every key is then queried and its target is its latest value.
* :func:`generate_block_mqar`: the sequence is ``num_blocks`` blocks, each a shared-vocabulary MQAR
  example of its own (K pairs, then queries of those keys); keys recur across blocks with new values,
  so the memory must let the old bindings go.

:func:`mqar_generator` picks one of them (or Zoology's MQAR) by name: the training task's
``data.mqar.variant``.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np
import torch

from .mqar import (
    _blank_examples,
    _distinct_uniform,
    _fill_noise,
    _place_pairs,
    _place_queries,
    _power_law_gaps,
    generate_mqar,
)

#: the MQAR variants a training task can draw: Zoology's, and the shared-vocabulary ones of this module
MQAR_VARIANTS = ("base", "shared", "update", "block")

#: a generator of MQAR examples: (num_examples, seq_len, num_kv_pairs, vocab_size, *, power_a, seed) -> (inputs, labels)
Generator = Callable[..., tuple[torch.LongTensor, torch.LongTensor]]


def _check_common(num_examples: int, num_kv_pairs: int, vocab_size: int, tokens_per_example: int,
                  power_a: float) -> None:
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if tokens_per_example > vocab_size - 1:
        raise ValueError(
            f"{tokens_per_example} distinct key and value tokens do not fit in the shared pool [1, {vocab_size}) "
            f"of vocab_size={vocab_size}; need vocab_size >= {tokens_per_example + 1}"
        )
    if power_a <= 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")


def _check_query_room(length: int, prefix: int, num_kv_pairs: int, what: str, name: str = "seq_len") -> None:
    if length < 1 or length % 2:
        raise ValueError(f"{name} must be even and positive (queries sit on even offsets), got {length}")
    if length - prefix < 2 * num_kv_pairs:
        raise ValueError(
            f"{what} takes {prefix} tokens and the {num_kv_pairs} queries need 2 * {num_kv_pairs} more: "
            f"{name} must be >= {prefix + 2 * num_kv_pairs}, got {length}"
        )


def _fill_queries(inputs: np.ndarray, labels: np.ndarray, rng: np.random.Generator, start: int, stop: int,
                  keys: np.ndarray, targets: np.ndarray, power_a: float, random_non_queries: bool,
                  vocab_size: int) -> None:
    """Queries of ``keys`` [N, K] (targets [N, K]) in positions [start, stop): noise first (if asked), then each
    key at ``start + 2 g`` with power-law gaps g."""
    N, K = keys.shape
    if random_non_queries:
        _fill_noise(inputs, rng, start, stop, vocab_size)
    _place_queries(inputs, labels, start, _power_law_gaps(rng, N, (stop - start) // 2, K, power_a), keys, targets)


def _pairs(rng: np.random.Generator, num_examples: int, vocab_size: int, num_tokens: int) -> np.ndarray:
    """[N, num_tokens] distinct tokens of the shared pool [1, vocab_size)."""
    return 1 + _distinct_uniform(rng, num_examples, vocab_size - 1, num_tokens)


def generate_shared_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """MQAR whose keys and values share the pool [1, V): inputs [N, L] and aligned labels [N, L].

    Positions 0 .. 2K-1 hold ``k_1 v_1 ... k_K v_K`` (2K distinct tokens); each key is queried once after
    them at an even offset, its value the label. Raises ValueError when the pairs do not fit: seq_len even
    and >= 4K, vocab_size >= 2K + 1.

    Example:
        >>> inputs, labels = generate_shared_mqar(2, 32, 4, 64, seed=0)
        >>> inputs.shape, int((labels != -100).sum())
        (torch.Size([2, 32]), 8)
    """
    K = num_kv_pairs
    _check_common(num_examples, K, vocab_size, 2 * K, power_a)
    _check_query_room(seq_len, 2 * K, K, "the context")
    rng = np.random.default_rng(seed)
    tokens = _pairs(rng, num_examples, vocab_size, 2 * K)
    keys, values = tokens[:, :K], tokens[:, K:]
    inputs, labels = _blank_examples(num_examples, seq_len)
    _place_pairs(inputs, 0, keys, values)
    _fill_queries(inputs, labels, rng, 2 * K, seq_len, keys, values, power_a, random_non_queries, vocab_size)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def generate_update_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    num_updates: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Update-MQAR: K pairs, then ``num_updates`` of the keys bound again; every key's latest value is recalled.

    Positions 0 .. 2K-1 hold the pairs ``k_i v_i``; positions 2K .. 2K+2U-1 hold U rebindings ``k_j w_j``
    (U distinct keys of the context in random order, each with a fresh value: the 2K + U tokens of an
    example are distinct); then each of the K keys is queried once, labelled ``w_j`` if it was rebound and
    ``v_i`` otherwise. Raises ValueError when it does not fit: seq_len even and >= 4K + 2U,
    0 <= U <= K, vocab_size >= 2K + U + 1.

    Example:
        >>> inputs, labels = generate_update_mqar(1, 24, 3, 64, num_updates=2, seed=0)
        >>> int((labels != -100).sum()), inputs.shape
        (3, torch.Size([1, 24]))
    """
    K, U = num_kv_pairs, num_updates
    if not 0 <= U <= K:
        raise ValueError(f"num_updates must be in [0, num_kv_pairs = {K}], got {U}")
    _check_common(num_examples, K, vocab_size, 2 * K + U, power_a)
    _check_query_room(seq_len, 2 * K + 2 * U, K, "the context and its updates")
    rng = np.random.default_rng(seed)
    tokens = _pairs(rng, num_examples, vocab_size, 2 * K + U)
    keys, values, fresh = tokens[:, :K], tokens[:, K:2 * K], tokens[:, 2 * K:]
    rebound = np.argsort(rng.random((num_examples, K)), axis=1)[:, :U]  # which keys, in the order rebound
    rows = np.arange(num_examples)[:, None]
    latest = values.copy()
    latest[rows, rebound] = fresh
    inputs, labels = _blank_examples(num_examples, seq_len)
    _place_pairs(inputs, 0, keys, values)
    _place_pairs(inputs, 2 * K, keys[rows, rebound], fresh)
    _fill_queries(inputs, labels, rng, 2 * K + 2 * U, seq_len, keys, latest, power_a, random_non_queries,
                  vocab_size)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def generate_block_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    num_blocks: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Block-MQAR: ``num_blocks`` shared-vocabulary MQAR examples back to back in one sequence.

    Block b occupies positions [b L/B, (b+1) L/B): its K pairs (2K distinct tokens, drawn anew for every
    block, so keys recur across blocks with other values), then one query of each of its keys, labelled
    with the value bound in the same block. Raises ValueError when it does not fit: seq_len divisible into
    num_blocks blocks of even length >= 4K, vocab_size >= 2K + 1.

    Example:
        >>> inputs, labels = generate_block_mqar(2, 48, 3, 32, num_blocks=2, seed=0)
        >>> int((labels != -100).sum(dim=1)[0]), int((labels[:, :24] != -100).sum(dim=1)[0])
        (6, 3)
    """
    K = num_kv_pairs
    if num_blocks < 1 or seq_len % num_blocks:
        raise ValueError(f"num_blocks must be >= 1 and divide seq_len={seq_len}, got {num_blocks}")
    block = seq_len // num_blocks
    _check_common(num_examples, K, vocab_size, 2 * K, power_a)
    _check_query_room(block, 2 * K, K, "a block's pairs", name="seq_len / num_blocks")
    rng = np.random.default_rng(seed)
    inputs, labels = _blank_examples(num_examples, seq_len)
    for b in range(num_blocks):
        start = b * block
        tokens = _pairs(rng, num_examples, vocab_size, 2 * K)
        keys, values = tokens[:, :K], tokens[:, K:]
        _place_pairs(inputs, start, keys, values)
        _fill_queries(inputs, labels, rng, start + 2 * K, start + block, keys, values, power_a, random_non_queries,
                      vocab_size)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def rebound_pairs(num_kv_pairs: int, update_fraction: float) -> int:
    """The keys Update-MQAR rebinds for K pairs: ``round(update_fraction * K)``, at least 1 and at most K."""
    return min(num_kv_pairs, max(1, round(update_fraction * num_kv_pairs)))


def mqar_generator(variant: str, *, update_fraction: float = 0.5, num_blocks: int = 2) -> Generator:
    """The generator of an MQAR variant: ``"base"`` (Zoology's :func:`~linmem.data.mqar.generate_mqar`),
    ``"shared"``, ``"update"`` (:func:`rebound_pairs` of the K keys rebound) or ``"block"`` (``num_blocks``
    blocks). Every one is called as ``generate(num_examples, seq_len, num_kv_pairs, vocab_size, power_a=...,
    seed=...)`` and labels every query with the value to recall, as :func:`~linmem.data.mqar.mqar_hits` scores.

    Example:
        >>> generate = mqar_generator("update", update_fraction=0.5)
        >>> inputs, labels = generate(4, 64, 8, 128, power_a=0.01, seed=0)
        >>> inputs.shape, int((labels != -100).sum()) // 4
        (torch.Size([4, 64]), 8)
    """
    if variant not in MQAR_VARIANTS:
        raise ValueError(f"unknown MQAR variant {variant!r}; valid: {', '.join(MQAR_VARIANTS)}")
    if not 0 < update_fraction <= 1:
        raise ValueError(f"update_fraction must lie in (0, 1], got {update_fraction}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if variant == "update":
        def generate_update(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, **kwargs):
            return generate_update_mqar(num_examples, seq_len, num_kv_pairs, vocab_size,
                                        num_updates=rebound_pairs(num_kv_pairs, update_fraction), **kwargs)

        return generate_update
    if variant == "block":
        return partial(generate_block_mqar, num_blocks=num_blocks)
    return generate_shared_mqar if variant == "shared" else generate_mqar
