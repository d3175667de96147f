"""``linmem tokenizer train``: a subword tokenizer trained on local text.

:func:`train_tokenizer` trains a byte-level BPE with Hugging Face ``tokenizers`` on local files
(default: the Python standard library's sources) and saves it as a ``transformers`` tokenizer
folder, which ``data.text.tokenizer`` of a training config, :func:`~linmem.data.codec.load_codec` and the
lm-eval bridge read.
Nothing here downloads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from .data.codec import BYTE_VOCAB_SIZE, TokenizerError, load_codec
from .data.sources import PathLike, stdlib_corpus, text_files

EOS_TOKEN = "<|endoftext|>"  # bos and eos of a trained tokenizer
PAD_TOKEN = "<|pad|>"
MIN_VOCAB_SIZE = BYTE_VOCAB_SIZE + 2  # the byte alphabet and the two special tokens


def train_tokenizer(
    out_dir: PathLike,
    vocab_size: int = 8192,
    paths: Optional[Sequence[PathLike]] = None,
    *,
    max_files: Optional[int] = None,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> Path:
    """Train a byte-level BPE on local text and save it as a ``transformers`` tokenizer folder.

    The texts are the files (and the .txt/.md/.rst/.py files inside the folders) of ``paths``,
    or, when ``paths`` is None or empty, the Python standard library's sources; ``max_files``
    caps how many are read; ``out_dir`` must be new or empty. Every byte is in the initial
    alphabet, so any text encodes; ``<|endoftext|>`` is the BOS and EOS token and ``<|pad|>`` the
    padding token. Returns
    ``out_dir``, loadable with ``AutoTokenizer.from_pretrained(out_dir)`` and :func:`~linmem.data.codec.load_codec`.

    Example:
        >>> import tempfile
        >>> folder = train_tokenizer(tempfile.mkdtemp(), vocab_size=300, max_files=2, show_progress=False)
        >>> load_codec(folder).vocab_size
        300
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes and 2 special tokens), "
                             f"got {vocab_size}")
    if min_frequency < 1:
        raise TokenizerError(f"min_frequency must be >= 1, got {min_frequency}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise TokenizerError(f"the output folder {out_dir} (--out) is a file: choose a folder")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise TokenizerError(f"the output folder {out_dir} (--out) exists and is not empty: choose a new one")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = text_files(list(paths)) if paths else stdlib_corpus(max_files=max_files)
    if paths and max_files is not None:
        texts = texts[:max_files]
    if not any(text.strip() for text in texts):
        raise TokenizerError(f"no text to train on in {list(paths) if paths else 'the standard library'}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                        pad_token=PAD_TOKEN)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """``linmem tokenizer train --out DIR --vocab-size N [--max-files N] [paths ...]``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_tokenizer_arguments(parser)
        >>> parser.parse_args(["train", "--out", "tok"]).vocab_size
        8192
    """
    sub = parser.add_subparsers(dest="tokenizer_command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on local text (default: the Python stdlib sources)")
    train.add_argument("--out", required=True,
                       help="the folder to write the tokenizer to (new or empty; save_pretrained format)")
    train.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary, special ones included")
    train.add_argument("--max-files", type=int, default=None, help="read at most this many files")
    train.add_argument("--min-frequency", type=int, default=2, help="merges seen fewer times are not learned")
    train.add_argument("paths", nargs="*", help="files or folders of text; none: the Python standard library")


def run_tokenizer_command(args: argparse.Namespace) -> int:
    """Run ``linmem tokenizer train`` with the arguments of :func:`add_tokenizer_arguments`; returns 0.

    Example:
        >>> run_tokenizer_command(argparse.Namespace(tokenizer_command="train", out="tok", vocab_size=8192,
        ...                                          max_files=None, min_frequency=2, paths=[]))  # doctest: +SKIP
    """
    if args.tokenizer_command != "train":
        raise TokenizerError(f"unknown tokenizer command {args.tokenizer_command!r}; valid: train")
    folder = train_tokenizer(args.out, args.vocab_size, args.paths or None, max_files=args.max_files,
                             min_frequency=args.min_frequency)
    codec = load_codec(folder)
    print(f"tokenizer of {codec.vocab_size} tokens written to {folder} "
          f"(set data.text.tokenizer={folder} to train on it)")
    return 0
