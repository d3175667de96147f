"""Multi-Query Associative Recall (MQAR), the recall task of Zoology.

Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models" (arXiv 2312.04927). One example of length L with K key-value pairs over a
vocabulary of V tokens:

    positions 0 .. 2K-1    k_1 v_1 k_2 v_2 ... k_K v_K          the context
    positions 2K .. L-1    key k_i again at position 2K + 2 g_i,  noise elsewhere

Keys come from [1, V/2) and values from [V/2, V), distinct within an example. The gap
indices g_i in [0, (L - 2K)/2) are drawn without replacement from the power law
P(g) ~ (g + 1)^(a - 1); the i-th draw belongs to the i-th key of the context.
Labels are aligned with the inputs (no shift): ``labels[t]`` is the target of the
prediction made at position t, i.e. value v_i at the position of the repeated key k_i,
and -100 everywhere else.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100

# (seq_len, num_kv_pairs) of Zoology's Figure 2 sweep.
MQAR_GRID: list[tuple[int, int]] = [(64, 4), (128, 8), (256, 16), (512, 64)]

# Zoology's MQAR sweeps use this one vocabulary size for every (seq_len, num_kv_pairs).
MQAR_VOCAB_SIZE = 8192

_GUMBEL_BLOCK = 1 << 22  # Gumbel scores drawn per block of rows, bounding memory


def generate_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    *,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """MQAR examples: inputs [N, L] and aligned labels [N, L] (-100 = ignore).

    Deterministic given ``seed`` (a numpy ``Generator``). With ``random_non_queries``
    the positions after the context that hold no query get uniform tokens from
    [0, V), as in Zoology; otherwise they hold 0. Labels are aligned (Zoology's loss
    compares logits[:, t] with labels[:, t]); ``shift_labels_right`` adapts them to a
    loss that shifts inside. Raises ValueError when the pairs do not fit: seq_len must
    be even and >= 4 * num_kv_pairs, and vocab_size >= 2 * (num_kv_pairs + 1).

    Example:
        >>> inputs, labels = generate_mqar(2, 64, 4, 8192, seed=0)
        >>> inputs.shape, int((labels != -100).sum())
        (torch.Size([2, 64]), 8)
    """
    _check_mqar_args(num_examples, seq_len, num_kv_pairs, vocab_size, power_a)
    rng = np.random.default_rng(seed)
    half = vocab_size // 2
    keys = 1 + _distinct_uniform(rng, num_examples, half - 1, num_kv_pairs)
    values = half + _distinct_uniform(rng, num_examples, vocab_size - half, num_kv_pairs)
    context = 2 * num_kv_pairs
    gaps = _power_law_gaps(rng, num_examples, (seq_len - context) // 2, num_kv_pairs, power_a)

    inputs, labels = _blank_examples(num_examples, seq_len)
    if random_non_queries:
        _fill_noise(inputs, rng, context, seq_len, vocab_size)
    _place_pairs(inputs, 0, keys, values)
    _place_queries(inputs, labels, context, gaps, keys, values)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


def mqar_hits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(labelled positions whose argmax equals the label, labelled positions), as whole numbers.

    logits: [N, L, V] (position t predicts ``labels[:, t]``), labels: [N, L], -100 = ignore.

    Example:
        >>> labels = torch.tensor([[-100, 3, -100, 1]])
        >>> mqar_hits(torch.nn.functional.one_hot(torch.tensor([[0, 3, 0, 2]]), 4).float(), labels)
        (1, 2)
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [N, L, V] and labels [N, L]; "
            f"got logits {tuple(logits.shape)}, labels {tuple(labels.shape)}"
        )
    mask = labels != IGNORE_INDEX
    return int((logits.argmax(dim=-1)[mask] == labels[mask]).sum()), int(mask.sum())


def mqar_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled positions whose argmax equals the label (Zoology's metric).

    logits: [N, L, V] (position t predicts ``labels[:, t]``), labels: [N, L], -100 = ignore.

    Example:
        >>> labels = torch.tensor([[-100, 3, -100, 1]])
        >>> mqar_accuracy(torch.nn.functional.one_hot(torch.tensor([[0, 3, 0, 2]]), 4).float(), labels)
        0.5
    """
    hits, total = mqar_hits(logits, labels)
    if total == 0:
        raise ValueError("labels has no position to score (every label is -100)")
    return hits / total


def shift_labels_right(labels: torch.Tensor) -> torch.LongTensor:
    """Aligned labels [N, L] -> labels for a loss that shifts inside ([N, L]).

    MQAR labels are aligned (``labels[t]`` is the target of logits at t). A causal LM
    loss that compares logits[:, t] with labels[:, t + 1] (``LinmemForCausalLM``,
    Hugging Face) needs them one step to the right; column 0 becomes -100.

    Example:
        >>> shift_labels_right(torch.tensor([[-100, 7, -100]])).tolist()
        [[-100, -100, 7]]
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [N, L], got {tuple(labels.shape)}")
    if bool((labels[:, -1] != IGNORE_INDEX).any()):
        raise ValueError("labels has a target at the last position, which a shifted loss cannot score")
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, 1:] = labels[:, :-1]
    return shifted


def _check_mqar_args(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float) -> None:
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if seq_len < 1 or seq_len % 2:
        raise ValueError(f"seq_len must be even and positive (queries sit on even offsets), got {seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(
            f"num_kv_pairs={num_kv_pairs} does not fit in seq_len={seq_len}: the context takes 2*K tokens and "
            f"the K queries need (seq_len - 2*K) / 2 >= K slots, so seq_len >= 4*K = {4 * num_kv_pairs}"
        )
    if num_kv_pairs > vocab_size // 2 - 1:
        raise ValueError(
            f"num_kv_pairs={num_kv_pairs} distinct keys do not fit in the key range [1, {vocab_size // 2}) "
            f"of vocab_size={vocab_size}; need vocab_size >= {2 * (num_kv_pairs + 1)}"
        )
    if power_a <= 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")


def _blank_examples(num_examples: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """inputs [N, L] of filler 0 and labels [N, L] of -100, int64."""
    inputs = np.zeros((num_examples, seq_len), dtype=np.int64)
    return inputs, np.full((num_examples, seq_len), IGNORE_INDEX, dtype=np.int64)


def _fill_noise(inputs: np.ndarray, rng: np.random.Generator, start: int, stop: int, vocab_size: int) -> None:
    """Uniform tokens of [0, vocab_size) in positions [start, stop) of every row of inputs [N, L]."""
    inputs[:, start:stop] = rng.integers(0, vocab_size, size=(inputs.shape[0], stop - start))


def _place_pairs(inputs: np.ndarray, start: int, keys: np.ndarray, values: np.ndarray) -> None:
    """``k_1 v_1 ... k_K v_K`` of keys, values [N, K] in positions [start, start + 2K) of inputs [N, L]."""
    K = keys.shape[1]
    inputs[:, start:start + 2 * K:2] = keys
    inputs[:, start + 1:start + 2 * K:2] = values


def _place_queries(inputs: np.ndarray, labels: np.ndarray, start: int, gaps: np.ndarray, keys: np.ndarray,
                   targets: np.ndarray) -> None:
    """Each key of keys [N, K] at position ``start + 2 g`` (gaps g [N, K]) of inputs [N, L], its target
    [N, K] at the same position of labels [N, L]."""
    rows = np.arange(keys.shape[0])[:, None]
    positions = start + 2 * gaps
    inputs[rows, positions] = keys
    labels[rows, positions] = targets


def _distinct_uniform(rng: np.random.Generator, rows: int, n: int, k: int) -> np.ndarray:
    """[rows, k] integers of [0, n), distinct within a row, uniform over ordered k-tuples.

    Draw with replacement, then redraw every entry that repeats an earlier one of its
    row until none does. The procedure commutes with relabelling [0, n), so its result
    is uniform over the injective tuples (a single orbit of that relabelling).
    """
    draws = rng.integers(0, n, size=(rows, k))
    todo = np.arange(rows)
    while todo.size:
        sub = draws[todo]
        repeats = _repeats_earlier(sub)
        sub[repeats] = rng.integers(0, n, size=int(repeats.sum()))
        draws[todo] = sub
        todo = todo[repeats.any(axis=1)]
    return draws


def _repeats_earlier(x: np.ndarray) -> np.ndarray:
    """Mask [rows, k]: True where x equals an entry at an earlier column of its row."""
    order = np.argsort(x, axis=1, kind="stable")
    ranked = np.take_along_axis(x, order, axis=1)
    repeat_ranked = np.zeros(x.shape, dtype=bool)
    repeat_ranked[:, 1:] = ranked[:, 1:] == ranked[:, :-1]
    mask = np.empty_like(repeat_ranked)
    np.put_along_axis(mask, order, repeat_ranked, axis=1)
    return mask


def _power_law_gaps(rng: np.random.Generator, rows: int, space: int, k: int, power_a: float) -> np.ndarray:
    """[rows, k] gap indices of [0, space), drawn one after another without replacement
    with P(g) ~ (g + 1)^(power_a - 1) renormalised over the gaps still free.

    Gumbel-top-k: sorting log P(g) + Gumbel noise gives exactly that successive draw
    order (the one of ``np.random.choice(space, k, replace=False, p=P)``).
    """
    log_p = (power_a - 1.0) * np.log(np.arange(1, space + 1, dtype=np.float64))
    gaps = np.empty((rows, k), dtype=np.int64)
    block = max(1, _GUMBEL_BLOCK // space)
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        scores = log_p + rng.gumbel(size=(stop - start, space))
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        by_score = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        gaps[start:stop] = np.take_along_axis(top, by_score, axis=1)
    return gaps
