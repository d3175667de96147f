"""Text <-> token ids: one :class:`Codec` for training, generation and evaluation.

Byte-level models (vocabulary 256, ``encode`` = UTF-8 bytes) read text through :func:`byte_codec`;
models trained with a tokenizer folder through :func:`load_codec` of it (:func:`hf_codec` of a loaded
tokenizer). Tokenizers come from local folders only; nothing here downloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

from .sources import DataError, PathLike, _existing

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

BYTE_VOCAB_SIZE = 256
NEWLINE_BYTE = 10  # a byte model's document separator: what an empty context starts from


class TokenizerError(ValueError):
    """A tokenizer that cannot be trained, loaded or used as asked."""


@dataclass(frozen=True)
class Codec:
    """How a model reads and writes text: UTF-8 bytes (``tokenizer`` None) or a Hugging Face tokenizer.

    ``encode(text) -> ids`` adds no special token; ``decode(ids) -> text`` never fails on valid ids
    (bytes that are not valid UTF-8 become U+FFFD); :meth:`encode_documents` ends each document with the
    tokenizer's EOS. ``eos_token_id`` ends a document (None for bytes); ``prefix_token_id`` is what a
    model conditions on when the context is empty (a newline byte, else EOS, else BOS).

    Example:
        >>> codec = byte_codec()
        >>> codec.encode("hé"), codec.decode([104, 195, 169]), codec.vocab_size
        ([104, 195, 169], 'hé', 256)
    """

    vocab_size: int  # ids lie in [0, vocab_size)
    tokenizer: Optional["PreTrainedTokenizerBase"] = None  # None: UTF-8 bytes
    name: str = "bytes"  # "bytes" or the tokenizer folder

    @property
    def eos_token_id(self) -> Optional[int]:
        """The token that ends a document (None for bytes)."""
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The context of an empty prompt: a newline byte, else the tokenizer's EOS, else its BOS."""
        if self.tokenizer is None:
            return NEWLINE_BYTE
        prefix = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.tokenizer.bos_token_id
        if prefix is None:
            raise TokenizerError(f"tokenizer {self.name!r} has neither an eos_token nor a bos_token; "
                                 "a model needs one of them to score text that has no context")
        return prefix

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens."""
        if self.tokenizer is None:
            return byte_tokenize(text)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids [T]."""
        if self.tokenizer is None:
            return byte_detokenize(ids)
        return self.tokenizer.decode([int(i) for i in ids])

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each document (no special tokens, then EOS with a tokenizer; EOS alone: empty)."""
        if self.tokenizer is None:
            return [byte_tokenize(t) for t in texts]
        return [ids if len(ids) > 1 else [] for ids in tokenize_documents(texts, self.tokenizer)]

    def special_tokens(self) -> dict[str, Optional[int]]:
        """bos/eos/pad token ids for the model config (the tokenizer's; none for bytes)."""
        if self.tokenizer is None:
            return {}
        t = self.tokenizer
        return {"bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id}


def byte_codec() -> Codec:
    """The codec of byte-level models: UTF-8 bytes as ids, vocabulary 256, no EOS.

    An empty context starts from a newline byte (how the text task joins documents).

    Example:
        >>> byte_codec().encode("ab")
        [97, 98]
    """
    return Codec(vocab_size=BYTE_VOCAB_SIZE)


def hf_codec(tokenizer: "PreTrainedTokenizerBase", name: str = "tokenizer") -> Codec:
    """The codec of a loaded Hugging Face tokenizer, named ``name`` (its folder).

    Example:
        >>> codec = hf_codec(load_tokenizer("runs/claims/tokenizer"))  # doctest: +SKIP
    """
    return Codec(vocab_size=len(tokenizer), tokenizer=tokenizer, name=name)


def load_codec(folder: Optional[PathLike]) -> Codec:
    """The codec of a tokenizer folder, or of bytes when ``folder`` is None.

    Example:
        >>> load_codec(None).name
        'bytes'
    """
    if folder is None:
        return byte_codec()
    return hf_codec(load_tokenizer(folder), name=str(Path(folder)))


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
    bad = [v for v in values if not 0 <= v < BYTE_VOCAB_SIZE]
    if bad:
        raise TokenizerError(f"byte token ids must lie in [0, {BYTE_VOCAB_SIZE}); got {bad[0]}")
    return bytes(values).decode("utf-8", errors="replace")


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
