"""The locally trained BPE tokenizer: what it saves, that the trainer and the codecs read it back,
and its command line."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from linmem.data.codec import TokenizerError, byte_codec, load_codec, load_tokenizer
from linmem.eval.niah import build_prompt
from linmem.tokenizer import add_tokenizer_arguments, run_tokenizer_command, train_tokenizer

from .conftest import write_corpus


def test_trained_tokenizer_round_trips_and_has_its_special_tokens(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    folder = train_tokenizer(tmp_path / "tok", vocab_size=300, paths=[corpus], show_progress=False)
    tokenizer = load_tokenizer(folder)  # what data.text.tokenizer reads
    assert len(tokenizer) == 300
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"
    codec = load_codec(folder)
    text = "alpha beta gamma\n    déjà vu 🙂"
    ids = codec.encode(text)
    assert codec.decode(ids) == text and max(ids) < 300
    assert len(codec.encode("alpha beta gamma delta")) < len(byte_codec().encode("alpha beta gamma delta"))
    assert codec.prefix_token_id == codec.eos_token_id == tokenizer.eos_token_id
    prompt = build_prompt("niah_single_1", 600, 50.0, codec.encode, max_new_tokens=10, rng=np.random.default_rng(0))
    assert 500 < len(prompt.ids) + 10 <= 600 and codec.decode(prompt.ids) == prompt.text


def test_tokenizer_command_and_its_errors(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", documents=3)
    parser = argparse.ArgumentParser()
    add_tokenizer_arguments(parser)
    args = parser.parse_args(["train", "--out", str(tmp_path / "tok"), "--vocab-size", "280", str(corpus)])
    assert run_tokenizer_command(args) == 0
    assert "280 tokens" in capsys.readouterr().out and load_codec(tmp_path / "tok").vocab_size == 280
    with pytest.raises(TokenizerError, match="vocab_size"):
        train_tokenizer(tmp_path / "bad", vocab_size=100, paths=[corpus])
    with pytest.raises(FileNotFoundError):
        load_codec(tmp_path / "missing")
