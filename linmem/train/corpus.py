"""The documents of a text run: where they come from, how they are split, how they become tokens.

Sources (``data.text``): the running Python's standard library sources (the default), local
files and folders, or a local Hugging Face dataset. The validation split is the dataset's own
``validation`` split when it has one, else a seeded ``val_fraction`` of the documents (split
before reading, so files are read one at a time). Texts become token ids through a
:class:`Codec` (UTF-8 bytes, or a local tokenizer with EOS after each document). Empty
documents are skipped and counted in the log; a split left without tokens is refused.

In-memory runs (:class:`~linmem.train.tasks.TextTask`) and ``linmem data prepare``
(:mod:`linmem.train.prepared`) read the same documents in the same order, so a run on a
prepared folder sees exactly the batches of the same run on the raw text.

Example:
    >>> from linmem.train.config import TextSection
    >>> splits = text_splits(TextSection(max_files=5, val_fraction=0.2), seed=0)
    >>> len(splits.train), len(splits.validation)
    (4, 1)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np

from .config import TextSection
from .data import (BYTE_VOCAB_SIZE, DataError, FileTexts, TokenDocuments, byte_detokenize, byte_tokenize,
                   list_text_files, load_tokenizer, local_dataset_splits, split_documents, stdlib_corpus,
                   tokenize_documents)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
    """The texts of the training and validation splits, and how the validation split was made."""

    train: Texts
    validation: Texts
    validation_source: str  # e.g. "the dataset's 'validation' split" or "2% of 400 documents"
    expect_validation: bool  # False when val_fraction = 0 and the dataset has no validation split


def text_splits(text: TextSection, seed: int) -> TextSplits:
    """The (unread) texts of ``text``'s source, split into training and validation."""
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
        train_rows, val_rows = split_documents(range(len(dataset)), text.val_fraction, seed)
        return TextSplits(DatasetTexts(dataset.select(train_rows), text.text_field, str(text.dataset)),
                          DatasetTexts(dataset.select(val_rows), text.text_field, str(text.dataset)),
                          _fraction_source(text.val_fraction, len(dataset)), text.val_fraction > 0)
    if text.paths:
        files = list_text_files(text.paths)[: text.max_files]
        train_files, val_files = split_documents(files, text.val_fraction, seed)
        return TextSplits(FileTexts(train_files, errors=text.errors, name="train split"),
                          FileTexts(val_files, errors=text.errors, name="validation split"),
                          _fraction_source(text.val_fraction, len(files)), text.val_fraction > 0)
    texts = stdlib_corpus(max_files=text.max_files)
    train, validation = split_documents(texts, text.val_fraction, seed)
    return TextSplits(train, validation, _fraction_source(text.val_fraction, len(texts)), text.val_fraction > 0)


def _fraction_source(val_fraction: float, documents: int) -> str:
    return f"{val_fraction:g} of {documents} documents"


@dataclass
class Codec:
    """Text <-> token ids: UTF-8 bytes, or a local tokenizer (documents end with its EOS)."""

    vocab_size: int
    tokenizer: Optional["PreTrainedTokenizerBase"] = None  # None: bytes
    source: str = "bytes"  # "bytes" or the tokenizer folder

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each document (no special tokens, then EOS with a tokenizer)."""
        if self.tokenizer is None:
            return [byte_tokenize(t) for t in texts]
        return [ids if len(ids) > 1 else [] for ids in tokenize_documents(texts, self.tokenizer)]  # EOS alone: empty

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt, as documents start (no special tokens)."""
        if self.tokenizer is None:
            return byte_tokenize(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return byte_detokenize(ids) if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def start_ids(self) -> list[int]:
        """What an empty prompt starts from: the end of a previous document (EOS, or a newline byte)."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return [self.tokenizer.eos_token_id]
        return self.encode("\n")

    def special_tokens(self) -> dict[str, Optional[int]]:
        """bos/eos/pad token ids for the model config (the tokenizer's; none for bytes)."""
        if self.tokenizer is None:
            return {}
        t = self.tokenizer
        return {"bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id}


def byte_codec() -> Codec:
    return Codec(vocab_size=BYTE_VOCAB_SIZE)


def tokenizer_codec(folder: Path) -> Codec:
    tokenizer = load_tokenizer(folder)
    return Codec(vocab_size=len(tokenizer), tokenizer=tokenizer, source=str(folder))


def section_codec(text: TextSection) -> Codec:
    """The codec a text section asks for (a tokenizer folder, or bytes)."""
    return tokenizer_codec(Path(text.tokenizer)) if text.tokenizer is not None else byte_codec()


@dataclass
class SplitCounts:
    """What tokenizing one split found."""

    documents: int = 0  # documents with at least one token
    tokens: int = 0
    empty: int = 0  # empty documents skipped


def tokenize_split(texts: Iterable[str], codec: Codec, name: str,
                   counts: Optional[SplitCounts] = None) -> Iterator[list[int]]:
    """Token ids of each non-empty document of a split, in order; skipped empty documents are
    counted (in ``counts`` when given) and logged when the split ends."""
    counts = counts if counts is not None else SplitCounts()
    batch: list[str] = []

    def flush() -> Iterator[list[int]]:
        for ids in codec.encode_documents(batch):
            if ids:
                counts.documents, counts.tokens = counts.documents + 1, counts.tokens + len(ids)
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


def check_split(name: str, counts: SplitCounts, splits: TextSplits, hint_source: str) -> None:
    """Refuse a split that holds no tokens (the validation split only when one is expected)."""
    if counts.tokens > 0 or (name == "validation" and not splits.expect_validation):
        return
    read = f"{counts.empty} empty document{'s' if counts.empty != 1 else ''}" if counts.empty else "no documents"
    hint = ("add documents, or set data.text.val_fraction=0 for no validation" if name == "validation"
            else "add documents")
    raise DataError(f"the {name} split of {hint_source} holds no tokens ({read}; validation: "
                    f"{splits.validation_source}): {hint}")


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
    description: str
    counts: dict[str, SplitCounts] = field(default_factory=dict)


def load_corpus(text: TextSection, seed: int) -> InMemoryCorpus:
    """Read, split and tokenize ``text``'s documents; refuse an empty split before training starts."""
    splits = text_splits(text, seed)
    codec = section_codec(text)
    source = describe_source(text)
    parts, counts = {}, {}
    for name, texts in (("train", splits.train), ("validation", splits.validation)):
        counts[name] = SplitCounts()
        docs = list(tokenize_split(texts, codec, name, counts[name]))
        check_split(name, counts[name], splits, source)
        parts[name] = _as_token_documents(docs)
    description = f"{source}, validation {splits.validation_source}"
    return InMemoryCorpus(codec, parts["train"], parts["validation"], description, counts)


def _as_token_documents(docs: list[list[int]]) -> TokenDocuments:
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if docs else np.empty(0, np.int64)
    return TokenDocuments(tokens, lengths)
