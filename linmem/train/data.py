"""Batches for the trainer: fixed-size examples, packed documents, local text and HF data.

A batch is a dict ``{"input_ids": [B, T] int64, "labels": [B, T] int64}`` (-100 =
ignore); a packed batch adds ``"cu_seqlens": [N + 1] int32`` and has B == 1. A batch
source is an infinite iterator; ``state_dict()`` (plain ints and strings, JSON-ready)
loaded into a fresh source makes it continue exactly at the next batch.

Nothing here downloads: datasets and tokenizers come from local paths only. A file that
cannot be read as what it should be raises :class:`DataError` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol, Sequence, TypeVar, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Batch = dict[str, torch.Tensor]
PathLike = Union[str, Path]
Item = TypeVar("Item")

BYTE_VOCAB_SIZE = 256
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

logger = logging.getLogger("linmem.train")


class DataError(ValueError):
    """A data source (text file, dataset, tokenizer, prepared folder) that cannot be used; names it."""


@dataclass
class TokenDocuments:
    """Documents as one token array and their lengths: the form packing reads.

    tokens: anything with ``len()`` whose slices ``tokens[a:b]`` are 1-D integer numpy arrays
    (an ``np.ndarray``, an ``np.memmap`` or :class:`~linmem.train.prepared.ShardedTokens`);
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


def byte_tokenize(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids in [0, 256).

    Example:
        >>> byte_tokenize("hé")
        [104, 195, 169]
    """
    return list(text.encode("utf-8"))


def byte_detokenize(ids: Union[Sequence[int], torch.Tensor]) -> str:
    """Text of byte token ids [T]; invalid UTF-8 becomes U+FFFD.

    Example:
        >>> byte_detokenize([104, 195, 169])
        'hé'
    """
    values = [int(i) for i in ids]
    if any(not 0 <= v < BYTE_VOCAB_SIZE for v in values):
        raise ValueError(f"byte token ids must lie in [0, {BYTE_VOCAB_SIZE})")
    return bytes(values).decode("utf-8", errors="replace")


def stdlib_corpus(max_files: Optional[int] = None) -> list[str]:
    """Sources of the running Python's standard library: one string per non-empty .py file.

    Files under ``sysconfig.get_paths()["stdlib"]`` in sorted path order, skipping test
    folders, site-packages and caches; the first ``max_files`` of them if given.

    Example:
        >>> len(stdlib_corpus(max_files=3))
        3
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    texts = (text for text in FileTexts(_stdlib_files(root)) if text.strip())
    corpus = list(islice(texts, max_files))
    if not corpus:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return corpus


def _stdlib_files(root: Path) -> list[Path]:
    """Sorted .py files under ``root``, not descending into skipped folders."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _STDLIB_SKIP]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(found)


def list_text_files(paths: Sequence[PathLike], suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """The given files, and the files with one of ``suffixes`` inside the given folders.

    Folders are searched recursively in sorted order, skipping hidden entries
    (e.g. ``.git``); paths keep the order given.

    Example:
        >>> files = list_text_files(["README.md", "docs/"])  # doctest: +SKIP
    """
    files = []
    for path in map(_existing, paths):
        if path.is_file():
            files.append(path)
            continue
        files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)))
    return files


def text_files(paths: Sequence[PathLike], suffixes: Sequence[str] = TEXT_SUFFIXES, *,
               errors: str = "replace") -> list[str]:
    """Texts of :func:`list_text_files` (see :class:`FileTexts` for ``errors``).

    Example:
        >>> docs = text_files(["README.md", "docs/"])  # doctest: +SKIP
    """
    return list(FileTexts(list_text_files(paths, suffixes), errors=errors))


class FileTexts:
    """The texts of ``files``, read one at a time as they are iterated.

    Invalid UTF-8 is replaced by U+FFFD (``errors="replace"``; how many files held some is
    logged at the end of each pass) or refused with a :class:`DataError` naming the file and
    the byte (``errors="strict"``).

    Example:
        >>> texts = FileTexts([Path("a.txt"), Path("b.txt")])  # doctest: +SKIP
        >>> len(texts), next(iter(texts))  # doctest: +SKIP
    """

    def __init__(self, files: Sequence[Path], *, errors: str = "replace", name: str = "text files") -> None:
        if errors not in ("replace", "strict"):
            raise ValueError(f"errors must be 'replace' or 'strict', got {errors!r}")
        self.files, self.errors, self.name = list(files), errors, name

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[str]:
        replaced = []
        for path in self.files:
            data = path.read_bytes()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as err:
                if self.errors == "strict":
                    raise DataError(f"{path} is not valid UTF-8 (byte {err.start}); "
                                    f"data.text.errors=replace replaces such bytes with U+FFFD") from err
                replaced.append(path)
                yield data.decode("utf-8", errors="replace")
        if replaced:
            names = ", ".join(str(p) for p in replaced[:3]) + (", ..." if len(replaced) > 3 else "")
            logger.warning("%s: %d of %d files held invalid UTF-8, replaced by U+FFFD (%s); "
                           "data.text.errors=strict refuses them", self.name, len(replaced), len(self.files), names)


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


def load_local_dataset(path: PathLike, *, text_field: str = "text", split: str = "train") -> list[str]:
    """The ``text_field`` column of a local Hugging Face dataset, as a list of strings.

    ``path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
    (a DatasetDict gives its ``split``), or a .json / .jsonl / .parquet file, or a folder
    of such files (one format); files are read with ``datasets.load_dataset`` (whose
    single split is "train"; slices like "train[:1000]" work).

    Example:
        >>> texts = load_local_dataset("data/corpus.jsonl")  # doctest: +SKIP
    """
    splits = local_dataset_splits(path, text_field=text_field, split=split)
    if split not in splits:
        raise DataError(f"split {split!r} not in {path}; it has {list(splits)}")
    return list(splits[split][text_field])


def local_dataset_splits(path: PathLike, *, text_field: str = "text", split: str = "train") -> dict[str, Any]:
    """The splits of a local dataset as ``datasets.Dataset`` objects (memory-mapped, not read yet).

    A ``DatasetDict.save_to_disk`` folder gives all its splits; a ``Dataset`` folder or data
    files give ``{split: ...}`` (files: ``split`` may slice, e.g. "train[:1000]"). Every split
    is checked to hold ``text_field``; unreadable files raise :class:`DataError` naming them.

    Example:
        >>> splits = local_dataset_splits("data/corpus")  # doctest: +SKIP
        >>> sorted(splits)  # doctest: +SKIP
        ['train', 'validation']
    """
    datasets = _import_datasets()
    path = _existing(path)
    if path.is_dir() and any((path / marker).exists() for marker in _SAVED_DATASET_MARKERS):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:  # datasets raises many kinds for damaged folders
            raise DataError(f"cannot load the dataset folder {path}: {type(err).__name__}: {err}") from err
        splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {split: loaded}
    else:
        builder, files = _data_files(path)
        if builder == "json":
            for file in files:
                _check_json_lines(file)
        try:
            splits = {split: datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split)}
        except Exception as err:
            names = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
            raise DataError(f"cannot read {names} as {builder} data: {type(err).__name__}: {err}") from err
    for name, part in splits.items():
        if text_field not in part.column_names:
            raise DataError(f"text_field {text_field!r} not in the columns {part.column_names} of {path} ({name})")
    return splits


def _check_json_lines(path: Path) -> None:
    """Name the first line of a .jsonl file that is not a JSON object (a .json file may be one document)."""
    if path.suffix != ".jsonl":
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number} is not valid JSON: {err.msg} (column {err.colno})") from err
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number} is a JSON {type(record).__name__}, not an object")


def load_tokenizer(folder: PathLike) -> "PreTrainedTokenizerBase":
    """``transformers.AutoTokenizer`` from a local folder (written by ``save_pretrained``); never downloads.

    Example:
        >>> tokenizer = load_tokenizer("checkpoints/tokenizer")  # doctest: +SKIP
    """
    folder = _existing(folder)
    if not folder.is_dir():
        raise NotADirectoryError(f"a tokenizer is a folder written by save_pretrained; got the file {folder}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, JSON and tokenizers errors here
        raise DataError(f"cannot load a tokenizer from {folder}: {type(err).__name__}: {err}") from err


def tokenize_documents(texts: Sequence[str], tokenizer: "PreTrainedTokenizerBase",
                       add_eos: bool = True) -> list[list[int]]:
    """Token ids of each text (no special tokens), followed by the tokenizer's EOS if ``add_eos``.

    Example:
        >>> docs = tokenize_documents(["hello world"], load_tokenizer("tok/"))  # doctest: +SKIP
    """
    if not texts:
        return []
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if not add_eos:
        return [list(ids) for ids in encoded]
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set one or pass add_eos=False")
    return [list(ids) + [tokenizer.eos_token_id] for ids in encoded]


def _import_datasets():
    try:
        import datasets
    except ImportError as error:
        raise ImportError("loading a Hugging Face dataset needs the optional package `datasets`: "
                          "pip install datasets (or linmem[data])") from error
    return datasets


def _existing(path: PathLike) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path} (only local paths are read; nothing is downloaded)")
    return path


def _data_files(path: Path) -> tuple[str, list[Path]]:
    """The ``datasets`` builder ("json" or "parquet") and the data files of a file or folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _DATA_FORMATS)
    formats = {_DATA_FORMATS.get(p.suffix) for p in files}
    if not files or None in formats:
        raise DataError(f"{path} is neither a save_to_disk folder nor {sorted(_DATA_FORMATS)} data")
    if len(formats) > 1:
        raise DataError(f"{path} mixes data formats {sorted(formats)}; point at one kind of file")
    return formats.pop(), files
