"""Local text and datasets: the standard library's sources, text files and folders, Hugging Face datasets.

Nothing here downloads: files, folders and datasets come from local paths only. A file that cannot be
read as what it should be raises :class:`DataError` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

PathLike = Union[str, Path]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

logger = logging.getLogger("linmem.train")


class DataError(ValueError):
    """A data source (text file, dataset, tokenizer, prepared folder) that cannot be used; names it."""


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
