"""Text <-> token ids for evaluation, and a subword tokenizer trained on local text.

A :class:`Codec` is what every text evaluation needs from a model's tokenizer: ``encode``,
``decode``, the vocabulary size and the token that ends (or, with an empty context, starts) a
document. Byte-level models (vocabulary 256, ``encode = UTF-8 bytes``) get :func:`byte_codec`;
models trained with a tokenizer folder get :func:`hf_codec` of it.

:func:`train_tokenizer` trains a byte-level BPE with Hugging Face ``tokenizers`` on local files
(default: the Python standard library's sources) and saves it as a ``transformers`` tokenizer
folder, which ``data.text.tokenizer`` of a training config and the lm-eval bridge read.
Nothing here downloads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PathLike = Union[str, Path]

BYTE_VOCAB_SIZE = 256
NEWLINE_BYTE = 10  # a byte model's document separator: what an empty context starts from
EOS_TOKEN = "<|endoftext|>"  # bos and eos of a trained tokenizer
PAD_TOKEN = "<|pad|>"
MIN_VOCAB_SIZE = BYTE_VOCAB_SIZE + 2  # the byte alphabet and the two special tokens


class TokenizerError(ValueError):
    """A tokenizer that cannot be trained, loaded or used as asked."""


@dataclass(frozen=True)
class Codec:
    """How a model reads and writes text.

    ``encode(text) -> ids`` adds no special token; ``decode(ids) -> text`` never fails (bytes
    that are not valid UTF-8 become U+FFFD). ``eos_token_id`` ends a document (None for bytes);
    ``prefix_token_id`` is what a model conditions on when the context is empty.

    Example:
        >>> codec = byte_codec()
        >>> codec.encode("hé"), codec.decode([104, 195, 169]), codec.vocab_size
        ([104, 195, 169], 'hé', 256)
    """

    name: str  # "bytes" or the tokenizer folder
    vocab_size: int  # ids lie in [0, vocab_size)
    encode: Callable[[str], list[int]]  # text -> ids, no special tokens
    decode: Callable[[Sequence[int]], str]  # ids -> text
    eos_token_id: Optional[int]  # end of document; None for bytes
    prefix_token_id: int  # the context of an empty prompt


def _encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _decode_bytes(ids: Sequence[int]) -> str:
    values = [int(i) for i in ids]
    bad = [v for v in values if not 0 <= v < BYTE_VOCAB_SIZE]
    if bad:
        raise TokenizerError(f"byte token ids must lie in [0, {BYTE_VOCAB_SIZE}); got {bad[0]}")
    return bytes(values).decode("utf-8", errors="replace")


def byte_codec() -> Codec:
    """The codec of byte-level models: UTF-8 bytes as ids, vocabulary 256, no EOS.

    An empty context starts from a newline byte (how the text task joins documents).

    Example:
        >>> byte_codec().encode("ab")
        [97, 98]
    """
    return Codec(name="bytes", vocab_size=BYTE_VOCAB_SIZE, encode=_encode_bytes, decode=_decode_bytes,
                 eos_token_id=None, prefix_token_id=NEWLINE_BYTE)


def hf_codec(tokenizer: "PreTrainedTokenizerBase", name: str = "tokenizer") -> Codec:
    """The codec of a Hugging Face tokenizer: ids without special tokens; EOS (else BOS) as the empty context.

    Example:
        >>> codec = hf_codec(load_tokenizer("runs/claims/tokenizer"))  # doctest: +SKIP
    """
    prefix = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if prefix is None:
        raise TokenizerError(f"tokenizer {name!r} has neither an eos_token nor a bos_token; "
                             "a model needs one of them to score text that has no context")

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode([int(i) for i in ids])

    return Codec(name=name, vocab_size=len(tokenizer), encode=encode, decode=decode,
                 eos_token_id=tokenizer.eos_token_id, prefix_token_id=prefix)


def load_codec(folder: Optional[PathLike]) -> Codec:
    """The codec of a tokenizer folder, or of bytes when ``folder`` is None.

    Example:
        >>> load_codec(None).name
        'bytes'
    """
    if folder is None:
        return byte_codec()
    from .train.data import load_tokenizer

    return hf_codec(load_tokenizer(folder), name=str(folder))


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
    ``out_dir``, loadable with ``AutoTokenizer.from_pretrained(out_dir)`` and :func:`load_codec`.

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

    from .train.data import stdlib_corpus, text_files

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
