"""Batches for the trainer: fixed-size examples, and documents packed into rows.

A batch is a dict ``{"input_ids": [B, T] int64, "labels": [B, T] int64}`` (-100 =
ignore); a packed batch adds ``"cu_seqlens": [N + 1] int32`` and has B == 1. A batch
source is an infinite iterator; ``state_dict()`` (plain ints and strings, JSON-ready)
loaded into a fresh source makes it continue exactly at the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

import numpy as np
import torch

Batch = dict[str, torch.Tensor]


@dataclass
class TokenDocuments:
    """Documents as one token array and their lengths: the form packing reads.

    tokens: anything with ``len()`` whose slices ``tokens[a:b]`` are 1-D integer numpy arrays
    (an ``np.ndarray``, an ``np.memmap`` or :class:`~linmem.data.prepared.ShardedTokens`);
    document d is ``tokens[starts[d]:starts[d] + lengths[d]]`` with starts the exclusive
    cumulative sum of lengths [D]. ``fingerprint`` identifies the data in a state_dict.

    Example:
        >>> docs = TokenDocuments(np.arange(5), np.array([2, 3]))
        >>> docs.num_tokens, len(docs), docs[1].tolist()
        (5, 2, [2, 3, 4])
    """

    tokens: Any  # [sum(lengths)] token ids
    lengths: np.ndarray  # [D] int64 tokens per document
    fingerprint: Optional[str] = None  # e.g. the SHA-256 of a prepared folder

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (self.lengths < 0).any():
            raise ValueError("lengths must be a 1-D array of non-negative document lengths")
        if int(self.lengths.sum()) != len(self.tokens):
            raise ValueError(f"document lengths sum to {int(self.lengths.sum())} "
                             f"but there are {len(self.tokens)} tokens")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        """Document ``index`` as a 1-D array of token ids."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        index %= len(self)
        start = int(self.lengths[:index].sum())
        return np.asarray(self.tokens[start:start + int(self.lengths[index])])

    def __iter__(self) -> Iterator[np.ndarray]:
        start = 0
        for length in self.lengths.tolist():
            yield np.asarray(self.tokens[start:start + length])
            start += length

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class BatchSource(Protocol):
    """What the trainer iterates: batches forever, resumable from ``state_dict()``."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def _check_seed(seed: int) -> None:
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


def _check_state(state: dict, expected: dict, counters: Sequence[str]) -> None:
    """Raise unless ``state`` has the counters and was saved by a source with ``expected`` settings."""
    missing = [key for key in (*expected, *counters) if key not in state]
    if missing:
        raise ValueError(f"state_dict lacks {missing}")
    differ = {key: (state[key], value) for key, value in expected.items() if state[key] != value}
    if differ:
        raise ValueError(f"state_dict was saved by a different source; (saved, here): {differ}")


class ExampleBatches:
    """Batches of fixed-size examples, reshuffled each epoch, infinite over epochs.

    inputs, labels: [N, L] integer tensors. Each batch holds ``batch_size`` examples
    (the last one of an epoch may be smaller when ``drop_last`` is False); the order of
    epoch e is a permutation seeded by (seed, e).

    Example:
        >>> x = torch.arange(12).view(6, 2)
        >>> batches = ExampleBatches(x, x, 4, seed=0)
        >>> next(batches)["input_ids"].shape
        torch.Size([4, 2])
    """

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, *, seed: int,
                 drop_last: bool = True) -> None:
        if inputs.dim() != 2 or labels.shape != inputs.shape:
            raise ValueError(f"inputs and labels must both be [N, L]; "
                             f"got {tuple(inputs.shape)} and {tuple(labels.shape)}")
        if inputs.dtype.is_floating_point or labels.dtype.is_floating_point:
            raise TypeError(f"inputs and labels must be integer tensors; got {inputs.dtype} and {labels.dtype}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(inputs) == 0 or (drop_last and batch_size > len(inputs)):
            raise ValueError(f"{len(inputs)} examples give no full batch of {batch_size}")
        _check_seed(seed)
        self.inputs, self.labels = inputs.long(), labels.long()
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.epoch, self.position = 0, 0
        self._order: tuple[int, torch.Tensor] = (-1, torch.empty(0))

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in one epoch."""
        full, rest = divmod(len(self.inputs), self.batch_size)
        return full + int(rest > 0 and not self.drop_last)

    def __iter__(self) -> "ExampleBatches":
        return self

    def __next__(self) -> Batch:
        n = len(self.inputs)
        if self.position >= n or (self.drop_last and self.position + self.batch_size > n):
            self.epoch, self.position = self.epoch + 1, 0
        index = self._permutation()[self.position:self.position + self.batch_size]
        self.position += len(index)
        return {"input_ids": self.inputs[index], "labels": self.labels[index]}

    def _permutation(self) -> torch.Tensor:
        if self._order[0] != self.epoch:
            order = _epoch_rng(self.seed, self.epoch).permutation(len(self.inputs))
            self._order = (self.epoch, torch.from_numpy(order))
        return self._order[1]

    def _settings(self) -> dict:
        return {"kind": "ExampleBatches", "seed": self.seed, "num_examples": len(self.inputs),
                "batch_size": self.batch_size, "drop_last": self.drop_last}

    def state_dict(self) -> dict:
        """Settings and position: {"kind", "seed", "num_examples", "batch_size", "drop_last", "epoch", "position"}."""
        return {**self._settings(), "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the batch after the one where ``state`` was taken (same settings required)."""
        _check_state(state, self._settings(), ("epoch", "position"))
        if not 0 <= int(state["position"]) <= len(self.inputs) or int(state["epoch"]) < 0:
            raise ValueError(f"state_dict position out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class PackedBatches:
    """Documents packed into rows of exactly ``tokens_per_batch`` tokens, infinite over epochs.

    documents: sequences of token ids (lists or 1-D tensors), or :class:`TokenDocuments`
    (e.g. memory-mapped shards, read a piece at a time). A document longer than
    ``max_document_tokens`` (and always one longer than ``tokens_per_batch``) is cut into
    pieces. Each epoch shuffles the documents (seed, epoch) and streams their pieces in
    order; rows are consecutive windows of that stream, one epoch flowing into the next,
    so every token of an epoch appears exactly once. A piece cut by the end of a row
    continues as a new segment of the next row. Batches are input_ids [1, T], labels
    [1, T] (= input_ids; the model shifts and masks sequence ends) and cu_seqlens
    [N + 1] int32 (the segment boundaries).

    Example:
        >>> batches = PackedBatches([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, seed=0)
        >>> batch = next(batches)
        >>> batch["input_ids"].shape, batch["cu_seqlens"].dtype
        (torch.Size([1, 4]), torch.int32)
    """

    def __init__(self, documents: Union[TokenDocuments, Sequence[Union[Sequence[int], torch.Tensor]]],
                 tokens_per_batch: int, *, seed: int, max_document_tokens: Optional[int] = None) -> None:
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        if max_document_tokens is not None and max_document_tokens < 1:
            raise ValueError(f"max_document_tokens must be >= 1 or None, got {max_document_tokens}")
        _check_seed(seed)
        if not isinstance(documents, TokenDocuments):
            documents = _flatten_documents(documents)
        if documents.num_tokens == 0:
            raise ValueError("documents hold no tokens")
        self.tokens, self.fingerprint = documents.tokens, documents.fingerprint
        self.tokens_per_batch, self.seed = tokens_per_batch, seed
        self.piece_tokens = min(tokens_per_batch, max_document_tokens or tokens_per_batch)
        self._cut_pieces(documents.lengths)
        self.epoch, self.piece, self.offset = 0, 0, 0
        self._order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def _cut_pieces(self, lengths: np.ndarray) -> None:
        """Piece table: start and length of each piece; first piece and count per document."""
        self.doc_pieces = -(-lengths // self.piece_tokens)
        self.doc_first_piece = np.cumsum(self.doc_pieces) - self.doc_pieces
        doc_starts = np.cumsum(lengths) - lengths
        doc_of_piece = np.repeat(np.arange(len(lengths)), self.doc_pieces)
        within = np.arange(len(doc_of_piece)) - self.doc_first_piece[doc_of_piece]
        self.piece_starts = doc_starts[doc_of_piece] + within * self.piece_tokens
        self.piece_lengths = np.minimum(self.piece_tokens, lengths[doc_of_piece] - within * self.piece_tokens)

    @property
    def tokens_per_epoch(self) -> int:
        """Number of tokens in one epoch (every document token once)."""
        return len(self.tokens)

    def __iter__(self) -> "PackedBatches":
        return self

    def __next__(self) -> Batch:
        segments: list[np.ndarray] = []
        filled = 0
        while filled < self.tokens_per_batch:
            order = self._piece_order(self.epoch)
            if self.piece == len(order):
                self.epoch, self.piece = self.epoch + 1, 0
                continue
            p = order[self.piece]
            take = min(self.tokens_per_batch - filled, int(self.piece_lengths[p]) - self.offset)
            start = int(self.piece_starts[p]) + self.offset
            segments.append(self.tokens[start:start + take])
            filled += take
            self.offset += take
            if self.offset == self.piece_lengths[p]:
                self.piece, self.offset = self.piece + 1, 0
        input_ids = torch.from_numpy(np.concatenate(segments).astype(np.int64))[None]
        cu_seqlens = torch.tensor([0] + [len(s) for s in segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return {"input_ids": input_ids, "labels": input_ids.clone(), "cu_seqlens": cu_seqlens}

    def _piece_order(self, epoch: int) -> np.ndarray:
        """Piece indices of ``epoch``: documents shuffled, the pieces of a document in order."""
        if self._order[0] != epoch:
            docs = _epoch_rng(self.seed, epoch).permutation(len(self.doc_pieces))
            counts = self.doc_pieces[docs]
            shift = self.doc_first_piece[docs] - (np.cumsum(counts) - counts)
            self._order = (epoch, np.repeat(shift, counts) + np.arange(counts.sum()))
        return self._order[1]

    def _settings(self) -> dict:
        return {"kind": "PackedBatches", "seed": self.seed, "tokens_per_batch": self.tokens_per_batch,
                "piece_tokens": self.piece_tokens, "num_documents": len(self.doc_pieces),
                "num_tokens": len(self.tokens), "fingerprint": self.fingerprint}

    def state_dict(self) -> dict:
        """Settings and stream position: {..., "epoch", "piece" (index in the epoch's order), "offset"}."""
        return {**self._settings(), "epoch": self.epoch, "piece": self.piece, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the batch after the one where ``state`` was taken (same documents and settings)."""
        state = {"fingerprint": None, **state}  # states of in-memory documents saved before fingerprints
        _check_state(state, self._settings(), ("epoch", "piece", "offset"))
        epoch, piece, offset = int(state["epoch"]), int(state["piece"]), int(state["offset"])
        if epoch < 0 or not 0 <= piece <= len(self.piece_lengths) or offset < 0:
            raise ValueError(f"state_dict position out of range: {state}")
        end = self.piece_lengths[self._piece_order(epoch)[piece]] if piece < len(self.piece_lengths) else 1
        if offset >= end:
            raise ValueError(f"state_dict offset {offset} lies past the end of its piece")
        self.epoch, self.piece, self.offset = epoch, piece, offset


def _flatten_documents(documents: Sequence[Union[Sequence[int], torch.Tensor]]) -> TokenDocuments:
    """All tokens in one int64 array [sum of lengths] and the document lengths [D]."""
    arrays = [np.asarray(doc, dtype=np.int64) for doc in documents]
    bad = [i for i, a in enumerate(arrays) if a.ndim != 1]
    if bad:
        raise ValueError(f"documents must be 1-D sequences of token ids; document {bad[0]} is not")
    tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"token ids must be >= 0, found {int(tokens.min())}")
    return TokenDocuments(tokens, np.array([len(a) for a in arrays], dtype=np.int64))
