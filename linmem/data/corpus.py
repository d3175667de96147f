"""The documents of a text run: where they come from, how they are split, how they become tokens.

Sources (``data.text``): the running Python's standard library sources (the default), local
files and folders, or a local Hugging Face dataset. The validation split is the dataset's own
``validation`` split when it has one, else a seeded ``val_fraction`` of the documents (split
before reading, so files are read one at a time). When the documents are too few for that
(``round(documents * val_fraction) < 1``: one file, a handful of files, a small dataset), the
split is by tokens instead: the last ``val_fraction`` of each document's tokens is held out (at
least one token stays in training), as nanoGPT holds out the tail of its one file. Each
document's tail rather than the tail of the whole stream: the validation text then samples every
document, not only the last one read. Texts become token ids through a :class:`Codec` (UTF-8
bytes, or a local tokenizer with EOS after each document). Empty documents are skipped and
counted in the log; a split left without tokens is refused.

In-memory runs (:class:`~linmem.train.tasks.TextTask`) and ``linmem data prepare``
(:mod:`linmem.data.prepared`) read the same documents in the same order, so a run on a
prepared folder sees exactly the batches of the same run on the raw text.

Example:
    >>> from linmem.data.config import TextSection
    >>> splits = text_splits(TextSection(max_files=5, val_fraction=0.2), seed=0)
    >>> len(splits.train), len(splits.validation), splits.how
    (4, 1, 'documents, 1 of 5 held out')
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence, TypeVar

import numpy as np

from .batches import TokenDocuments
from .codec import Codec, load_codec
from .config import TextSection
from .sources import DataError, FileTexts, list_text_files, local_dataset_splits, stdlib_corpus

Item = TypeVar("Item")

logger = logging.getLogger("linmem.train")

ENCODE_BATCH = 256  # texts tokenized per tokenizer call


class Texts(Protocol):
    """A split's texts: a known count, read in order as they are iterated."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]: ...


class DatasetTexts:
    """The ``text_field`` column of a ``datasets.Dataset``, read a batch of rows at a time."""

    def __init__(self, dataset: Any, text_field: str, name: str) -> None:
        self.dataset, self.text_field, self.name = dataset, text_field, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[str]:
        row = 0
        for batch in self.dataset.iter(batch_size=1000):
            for value in batch[self.text_field]:
                if value is not None and not isinstance(value, str):
                    raise DataError(f"{self.name}: row {row} of column {self.text_field!r} holds a "
                                    f"{type(value).__name__}, not text")
                yield value or ""
                row += 1


@dataclass
class TextSplits:
    """The texts of the training and validation splits, and how the validation split was made.

    With ``tail_fraction`` > 0 the split is by tokens: ``validation`` is empty, and the last
    ``tail_fraction`` of each document of ``train`` is held out when it is tokenized
    (:func:`tokenize_splits`).
    """

    train: Texts
    validation: Texts
    how: str  # how the split was made, e.g. "documents, 8 of 400 held out", "the dataset's 'validation' split"
    expect_validation: bool  # False when val_fraction = 0 and the dataset has no validation split
    tail_fraction: float = 0.0  # > 0: held out by tokens, the last tail_fraction of each document


def split_documents(docs: Sequence[Item], val_fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """Random (train, validation) split, deterministic given ``seed``; each keeps the input order.

    The validation part has round(len(docs) * val_fraction) documents, at least one when
    val_fraction > 0, and always leaves one for training.

    Example:
        >>> train, val = split_documents(list("abcdefghij"), 0.2, seed=0)
        >>> len(train), len(val)
        (8, 2)
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    n = len(docs)
    n_val = min(n - 1, max(1, round(n * val_fraction))) if val_fraction > 0 and n > 1 else 0
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    return [d for d, v in zip(docs, is_val) if not v], [d for d, v in zip(docs, is_val) if v]


def _split(items: Sequence[Item], val_fraction: float, seed: int) -> tuple[list[Item], list[Item], str, float]:
    """(train items, validation items, how, tail fraction): by documents when there are enough to hold
    out ``val_fraction`` of them, else every item trains and its token tail is held out."""
    n = len(items)
    if val_fraction == 0:
        return list(items), [], "none (val_fraction 0)", 0.0
    if n >= 2 and round(n * val_fraction) >= 1:
        train, validation = split_documents(items, val_fraction, seed)
        return train, validation, f"documents, {len(validation):,} of {n:,} held out", 0.0
    return (list(items), [], f"token tail, the last {val_fraction:g} of each of {counted(n, 'document')} (too few "
            "documents to hold out whole ones)", val_fraction)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n == 1: ``counted(1, "document")`` is "1 document"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def text_splits(text: TextSection, seed: int) -> TextSplits:
    """The (unread) texts of ``text``'s source, split into training and validation (see the module docstring)."""
    if text.max_files is not None and text.max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None, got {text.max_files}")
    if text.dataset is not None:
        splits = local_dataset_splits(text.dataset, text_field=text.text_field)
        if "train" not in splits:
            raise DataError(f"the dataset {text.dataset} has no 'train' split; it has {list(splits)}")
        if "validation" in splits:
            return TextSplits(DatasetTexts(splits["train"], text.text_field, f"{text.dataset} (train)"),
                              DatasetTexts(splits["validation"], text.text_field, f"{text.dataset} (validation)"),
                              "the dataset's 'validation' split", True)
        dataset = splits["train"]
        train_rows, val_rows, how, tail = _split(range(len(dataset)), text.val_fraction, seed)
        return TextSplits(DatasetTexts(dataset.select(train_rows), text.text_field, str(text.dataset)),
                          DatasetTexts(dataset.select(val_rows), text.text_field, str(text.dataset)),
                          how, text.val_fraction > 0, tail)
    if text.paths:
        files = list_text_files(text.paths)[: text.max_files]
        train_files, val_files, how, tail = _split(files, text.val_fraction, seed)
        return TextSplits(FileTexts(train_files, errors=text.errors, name="train split"),
                          FileTexts(val_files, errors=text.errors, name="validation split"),
                          how, text.val_fraction > 0, tail)
    texts = stdlib_corpus(max_files=text.max_files)
    train, validation, how, tail = _split(texts, text.val_fraction, seed)
    return TextSplits(train, validation, how, text.val_fraction > 0, tail)


def section_codec(text: TextSection) -> Codec:
    """The codec a text section asks for (a tokenizer folder, or bytes)."""
    return load_codec(text.tokenizer)


@dataclass
class SplitCounts:
    """What tokenizing one split found."""

    documents: int = 0  # documents with at least one token
    tokens: int = 0
    empty: int = 0  # empty documents skipped

    def add(self, tokens: int) -> None:
        """Count one document (or piece) of ``tokens`` tokens (> 0)."""
        self.documents, self.tokens = self.documents + 1, self.tokens + tokens


def tokenize_split(texts: Iterable[str], codec: Codec, name: str,
                   counts: Optional[SplitCounts] = None) -> Iterator[list[int]]:
    """Token ids of each non-empty document of a split, in order; skipped empty documents are
    counted (in ``counts`` when given) and logged when the split ends."""
    counts = counts if counts is not None else SplitCounts()
    batch: list[str] = []

    def flush() -> Iterator[list[int]]:
        for ids in codec.encode_documents(batch):
            if ids:
                counts.add(len(ids))
                yield ids
            else:
                counts.empty += 1
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == ENCODE_BATCH:
            yield from flush()
    yield from flush()
    if counts.empty:
        logger.info("%s split: skipped %d empty document%s", name, counts.empty, "s" if counts.empty > 1 else "")


def tokenize_splits(splits: TextSplits, codec: Codec,
                    counts: dict[str, SplitCounts]) -> Iterator[tuple[str, list[int]]]:
    """("train" or "validation", token ids) of every non-empty document or piece, in the order both
    in-memory runs and prepared folders store them; ``counts`` ({"train": ..., "validation": ...})
    receive what was found.

    Split by documents: the training documents, then the validation ones. Split by tokens
    (``splits.tail_fraction`` > 0): each document's head (training), then its tail (validation) of
    ``round(tail_fraction * tokens)`` tokens, at most all but one (empty documents count as training's).

    Example:
        >>> from linmem.data.codec import byte_codec
        >>> splits = TextSplits(["abcdefghij"], [], "token tail", True, tail_fraction=0.2)
        >>> counts = {"train": SplitCounts(), "validation": SplitCounts()}
        >>> [(name, len(ids)) for name, ids in tokenize_splits(splits, byte_codec(), counts)]
        [('train', 8), ('validation', 2)]
    """
    if not splits.tail_fraction:
        for name, texts in (("train", splits.train), ("validation", splits.validation)):
            yield from ((name, ids) for ids in tokenize_split(texts, codec, name, counts[name]))
        return
    documents = SplitCounts()
    for ids in tokenize_split(splits.train, codec, "train", documents):
        held = min(len(ids) - 1, round(len(ids) * splits.tail_fraction))
        for name, piece in (("train", ids[:len(ids) - held]), ("validation", ids[len(ids) - held:])):
            if piece:
                counts[name].add(len(piece))
                yield name, piece
    counts["train"].empty += documents.empty


def check_split(name: str, counts: SplitCounts, splits: TextSplits, hint_source: str) -> None:
    """Refuse a split that holds no tokens (the validation split only when one is expected)."""
    if counts.tokens > 0 or (name == "validation" and not splits.expect_validation):
        return
    read = f"{counts.empty} empty document{'s' if counts.empty != 1 else ''}" if counts.empty else "no documents"
    hint = ("add text, raise data.text.val_fraction, or set data.text.val_fraction=0 for no validation"
            if name == "validation" else "add documents")
    raise DataError(f"the {name} split of {hint_source} holds no tokens ({read}; validation: "
                    f"{splits.how}): {hint}")


def describe_source(text: TextSection) -> str:
    if text.dataset is not None:
        return f"the dataset {text.dataset}"
    if text.paths:
        return ", ".join(text.paths)
    return "the Python standard library"


@dataclass
class InMemoryCorpus:
    """Both splits tokenized into memory (the runs that do not use a prepared folder)."""

    codec: Codec
    train: TokenDocuments
    validation: TokenDocuments
    source: str  # where the text came from
    split: str  # how the validation split was made (TextSplits.how)
    counts: dict[str, SplitCounts] = field(default_factory=dict)


def load_corpus(text: TextSection, seed: int) -> InMemoryCorpus:
    """Read, split and tokenize ``text``'s documents; refuse an empty split before training starts."""
    splits = text_splits(text, seed)
    codec = section_codec(text)
    source = describe_source(text)
    counts = {name: SplitCounts() for name in ("train", "validation")}
    docs: dict[str, list[list[int]]] = {"train": [], "validation": []}
    for name, ids in tokenize_splits(splits, codec, counts):
        docs[name].append(ids)
    for name in docs:
        check_split(name, counts[name], splits, source)
    return InMemoryCorpus(codec, _as_token_documents(docs["train"]), _as_token_documents(docs["validation"]),
                          source, splits.how, counts)


def _as_token_documents(docs: list[list[int]]) -> TokenDocuments:
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if docs else np.empty(0, np.int64)
    return TokenDocuments(tokens, lengths)
