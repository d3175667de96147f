"""Token shards: a corpus tokenized once (``linmem data prepare``) and memory-mapped by training.

A prepared folder holds, for each split (``train``, ``validation``)::

    tokens_<split>_<k>.bin   token ids back to back, uint16 (vocabulary <= 65536) or uint32
    index_<split>_<k>.npy    int64 [D_k]: the end offset of each document in its shard

and ``manifest.json`` (format, codec, vocabulary and special tokens, source and split
settings, per-split and per-shard counts, the SHA-256 of every file and of them all, the
data's fingerprint), plus ``tokenizer/`` when a tokenizer made the tokens. A document never
spans two shards. :func:`verify_prepared` hashes the files against those sums: the trainer calls
it whenever it starts or resumes a run, evaluation for the validation split it reads. The
documents and their order are those of an in-memory run on the same source and seed
(:mod:`linmem.data.corpus`), so training reads the same batches; only the piece table of
packing and the document index live in memory, the tokens stay on disk.

Example:
    >>> from linmem.data.config import TextSection
    >>> manifest = prepare_corpus(TextSection(max_files=20), "data/stdlib")  # doctest: +SKIP
    >>> corpus = open_prepared("data/stdlib")  # doctest: +SKIP
    >>> corpus.train.num_tokens == manifest["splits"]["train"]["tokens"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Sequence, Union

import numpy as np

from .batches import TokenDocuments
from .codec import Codec, byte_codec, load_codec
from .config import TextSection
from .corpus import SplitCounts, check_split, describe_source, section_codec, text_splits, tokenize_splits
from .sources import DataError

logger = logging.getLogger("linmem.train")

FORMAT = "linmem-prepared/1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "validation")
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens per shard
VERIFY_REPORT_BYTES = 2 << 30  # hashing more than this (over a second on one core) is reported as it goes
VERIFY_REPORT_SECONDS = 10.0  # between two progress lines of a long verification


class ShardedTokens:
    """The tokens of several shards as one array: ``len()`` and slices inside one shard.

    Example:
        >>> tokens = ShardedTokens([np.arange(3), np.arange(10, 12)])
        >>> len(tokens), tokens[3:5].tolist()
        (5, [10, 11])
    """

    def __init__(self, shards: list[np.ndarray]) -> None:
        self.shards = shards
        self.starts = np.cumsum([0] + [len(s) for s in shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"ShardedTokens takes contiguous slices, got {index!r}")
        start, stop, _ = index.indices(len(self))
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        if stop > self.starts[shard + 1]:
            raise IndexError(f"slice {start}:{stop} crosses the end of shard {shard}; documents never do")
        offset = int(self.starts[shard])
        return self.shards[shard][start - offset:stop - offset]


class _ShardWriter:
    """Writes one split's documents into shards of about ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int, vocab_size: int) -> None:
        self.folder, self.split, self.dtype = folder, split, dtype
        self.shard_tokens, self.vocab_size = shard_tokens, vocab_size
        self.shards: list[dict[str, Any]] = []
        self.file: Optional[BinaryIO] = None
        self.ends: list[int] = []
        self.digest = hashlib.sha256()

    def add(self, ids: list[int]) -> None:
        if self.file is not None and self.ends[-1] + len(ids) > self.shard_tokens:
            self.close()
        if self.file is None:
            self.ends, self.digest = [0], hashlib.sha256()
            self.file = open(self.folder / f"tokens_{self.split}_{len(self.shards):05d}.bin", "wb")
        array = np.asarray(ids, dtype=np.int64)
        if array.min() < 0 or array.max() >= self.vocab_size:
            raise DataError(f"token id {int(array.max())} outside the vocabulary of {self.vocab_size}")
        data = array.astype(self.dtype).tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.ends.append(self.ends[-1] + len(ids))

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; returns every shard's manifest entry."""
        if self.file is None:
            return self.shards
        self.file.close()
        name = Path(self.file.name).name
        index = f"index_{self.split}_{len(self.shards):05d}.npy"
        np.save(self.folder / index, np.array(self.ends[1:], dtype=np.int64))
        self.shards.append({"tokens_file": name, "index_file": index, "documents": len(self.ends) - 1,
                            "tokens": self.ends[-1], "sha256": self.digest.hexdigest(),
                            "index_sha256": _sha256(self.folder / index)})
        self.file = None
        return self.shards


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_corpus(text: TextSection, out: Union[str, Path], *, seed: int = 0,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS) -> dict[str, Any]:
    """Tokenize ``text``'s source once into the shards of a new folder ``out``; returns the manifest.

    ``seed`` picks the validation documents as ``data.seed`` does for an in-memory run
    (unless the dataset has its own validation split); too few documents are split by their
    token tails, as in-memory runs split them (:mod:`linmem.data.corpus`). The folder is written
    under a temporary name and renamed when complete; ``out`` must not exist or be empty.
    """
    out = Path(out)
    if text.prepared is not None:
        raise DataError("the source of a prepared folder cannot itself be a prepared folder")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists and is not an empty folder: choose a new one")
    splits = text_splits(text, seed)
    codec = section_codec(text)
    dtype = np.dtype(np.uint16 if codec.vocab_size <= 1 << 16 else np.uint32)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        counts = {name: SplitCounts() for name in SPLITS}
        writers = {name: _ShardWriter(tmp, name, dtype, shard_tokens, codec.vocab_size) for name in SPLITS}
        for name, ids in tokenize_splits(splits, codec, counts):
            writers[name].add(ids)
        manifest_splits = {}
        for name in SPLITS:
            check_split(name, counts[name], splits, describe_source(text))
            manifest_splits[name] = {**asdict(counts[name]), "shards": writers[name].close()}
        if codec.tokenizer is not None:
            codec.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        every = hashlib.sha256()
        for name in SPLITS:
            for shard in manifest_splits[name]["shards"]:
                every.update(f"{name}:{shard['sha256']}:{shard['index_sha256']};".encode())
        manifest = {
            "format": FORMAT, "codec": "bytes" if codec.tokenizer is None else TOKENIZER_DIR,
            "tokenizer_source": codec.name, "vocab_size": codec.vocab_size, "dtype": dtype.name,
            "special_tokens": codec.special_tokens(),
            "source": {"paths": list(text.paths), "dataset": text.dataset, "text_field": text.text_field,
                       "max_files": text.max_files, "errors": text.errors},
            "validation": splits.how, "val_fraction": text.val_fraction, "seed": seed,
            "splits": manifest_splits, "sha256": every.hexdigest(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


@dataclass
class PreparedCorpus:
    """A prepared folder opened for training: its codec and both splits, memory-mapped."""

    folder: Path
    manifest: dict[str, Any]
    codec: Codec
    train: TokenDocuments
    validation: TokenDocuments

    @property
    def source(self) -> str:
        return f"prepared {self.folder}"

    @property
    def split(self) -> str:
        """How the validation split was made (when the folder was prepared)."""
        return self.manifest["validation"]


def open_prepared(folder: Union[str, Path]) -> PreparedCorpus:
    """Open a folder of :func:`prepare_corpus`; every shard's size and index are checked against
    the manifest (a mismatch raises :class:`DataError` naming the file), the tokens are not read."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"{folder} is not a prepared folder (no {MANIFEST}); write one with `linmem data prepare`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                        f"expected {FORMAT!r}")
    try:
        codec = byte_codec() if manifest["codec"] == "bytes" else load_codec(folder / TOKENIZER_DIR)
        dtype = np.dtype(manifest["dtype"])
        parts = {name: _open_split(folder, manifest["splits"][name], dtype, manifest["sha256"]) for name in SPLITS}
    except (KeyError, TypeError) as err:
        raise DataError(f"{path} lacks or garbles the entry {err}") from err
    if codec.vocab_size != manifest["vocab_size"]:
        raise DataError(f"{folder / TOKENIZER_DIR} has {codec.vocab_size} tokens, the manifest says "
                        f"{manifest['vocab_size']}")
    return PreparedCorpus(folder, manifest, codec, parts["train"], parts["validation"])


def _open_split(folder: Path, split: dict[str, Any], dtype: np.dtype, fingerprint: str) -> TokenDocuments:
    shards, lengths = [], []
    for shard in split["shards"]:
        tokens_path, index_path = folder / shard["tokens_file"], folder / shard["index_file"]
        for file in (tokens_path, index_path):
            if not file.is_file():
                raise DataError(f"{file} is missing from the prepared folder")
        expected = shard["tokens"] * dtype.itemsize
        if tokens_path.stat().st_size != expected:
            raise DataError(f"{tokens_path} holds {tokens_path.stat().st_size} bytes, the manifest says {expected}")
        try:
            ends = np.load(index_path, allow_pickle=False)
        except ValueError as err:
            raise DataError(f"{index_path} is not a document index: {err}") from err
        if ends.shape != (shard["documents"],) or (len(ends) and ends[-1] != shard["tokens"]):
            raise DataError(f"{index_path} does not match {tokens_path} ({len(ends)} documents, "
                            f"manifest {shard['documents']})")
        shards.append(np.memmap(tokens_path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
        lengths.append(np.diff(ends, prepend=0))
    all_lengths = np.concatenate(lengths) if lengths else np.empty(0, dtype=np.int64)
    return TokenDocuments(ShardedTokens(shards), all_lengths, fingerprint=fingerprint)


def verify_prepared(folder: Union[str, Path], splits: Sequence[str] = SPLITS) -> None:
    """Check every token shard and document index of ``splits`` against the manifest's SHA-256 sums.

    The folder's structure is checked first (:func:`open_prepared`); a file whose sum differs raises
    :class:`DataError` naming it, so a shard overwritten in place (same size, even with valid token
    ids) is refused before training reads it. Files are hashed in parallel threads (about 1.2-1.5 GB/s
    a core); more than ``VERIFY_REPORT_BYTES`` is reported on the ``linmem.train`` logger as it goes.
    No result is cached: only the contents prove that a file is unchanged (a same-size copy may keep
    its modification time, and damage on disk changes neither).

    Example:
        >>> verify_prepared("data/stdlib")  # doctest: +SKIP
        >>> verify_prepared("data/stdlib", splits=("validation",))  # doctest: +SKIP
    """
    corpus = open_prepared(folder)
    files = [(corpus.folder / shard[name], shard[digest]) for split in splits
             for shard in corpus.manifest["splits"][split]["shards"]
             for name, digest in (("tokens_file", "sha256"), ("index_file", "index_sha256"))]
    progress = _HashProgress(corpus.folder, [path for path, _ in files])
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1, 8)))
    try:
        for (path, expected), actual in zip(files, pool.map(_sha256, [path for path, _ in files])):
            if actual != expected:
                raise DataError(f"{path} does not match its SHA-256 sum in {corpus.folder / MANIFEST} (the file "
                                f"changed after `linmem data prepare`): prepare the folder again")
            progress.done(path)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    progress.close()


class _HashProgress:
    """Log lines of a long verification: its size at the start, bytes done every few seconds, its rate."""

    def __init__(self, folder: Path, paths: list[Path]) -> None:
        self.folder, self.files = folder, len(paths)
        self.total, self.hashed = sum(path.stat().st_size for path in paths), 0
        self.start = self.last = time.monotonic()
        self.enabled = self.total > VERIFY_REPORT_BYTES
        if self.enabled:
            logger.info("checking %.1f GB in %d files of %s against their SHA-256 sums", self.total / 1e9,
                        self.files, folder)

    def done(self, path: Path) -> None:
        self.hashed += path.stat().st_size
        now = time.monotonic()
        if self.enabled and now - self.last >= VERIFY_REPORT_SECONDS:
            self.last = now
            logger.info("checked %.1f of %.1f GB", self.hashed / 1e9, self.total / 1e9)

    def close(self) -> None:
        if self.enabled:
            seconds = time.monotonic() - self.start
            logger.info("%s: %d files match their SHA-256 sums (%.1f GB in %.1f s, %.2f GB/s)", self.folder,
                        self.files, self.total / 1e9, seconds, self.total / 1e9 / max(seconds, 1e-9))
