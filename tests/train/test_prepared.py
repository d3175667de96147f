"""Prepared token shards (``linmem data prepare``): the in-memory run's batches from memory-mapped
files, exact resume, a damaged folder named, and the tokenizer saved with the model."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
import torch

from linmem.cli import main
from linmem.data.batches import PackedBatches
from linmem.data.config import TextSection
from linmem.data.corpus import load_corpus
from linmem.data.prepared import open_prepared, prepare_corpus
from linmem.data.sources import DataError
from linmem.train import Trainer, load_config
from linmem.train.runs import load_run

WORDS = "the cat sat on a mat while dog ran far away and bird flew over green hills".split()


def _corpus(folder, documents=14, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for i in range(documents):
        words = rng.choice(WORDS, size=int(rng.integers(3, 40)))
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words) + ".\n")
    (folder / "__init__.py").write_text("")  # an empty document, skipped and counted
    return folder


def test_prepared_shards_give_the_batches_of_the_in_memory_run(tmp_path):
    section = TextSection(paths=[str(_corpus(tmp_path / "corpus"))], val_fraction=0.2)
    manifest = prepare_corpus(section, tmp_path / "prepared", seed=3, shard_tokens=300)
    train = manifest["splits"]["train"]
    assert len(train["shards"]) > 1 and manifest["dtype"] == "uint16"
    assert train["empty"] + manifest["splits"]["validation"]["empty"] == 1
    prepared, in_memory = open_prepared(tmp_path / "prepared"), load_corpus(section, seed=3)
    assert all(isinstance(shard, np.memmap) for shard in prepared.train.tokens.shards)
    assert np.array_equal(prepared.validation.lengths, in_memory.validation.lengths)
    make = lambda docs: PackedBatches(docs, 64, seed=1, max_document_tokens=40)  # noqa: E731
    expected = list(islice(make(in_memory.train), 40))  # several epochs
    source = make(prepared.train)
    got = list(islice(source, 17))
    state = json.loads(json.dumps(source.state_dict()))
    assert state["fingerprint"] == manifest["sha256"]
    resumed = make(open_prepared(tmp_path / "prepared").train)
    resumed.load_state_dict(state)
    got += list(islice(resumed, 23))
    for a, b in zip(expected, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="different source"):
        make(in_memory.train).load_state_dict(state)
    with pytest.raises(DataError, match="already exists"):
        prepare_corpus(section, tmp_path / "prepared")
    shard = tmp_path / "prepared" / train["shards"][0]["tokens_file"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"tokens_train_00000.bin holds \d+ bytes, the manifest says"):
        open_prepared(tmp_path / "prepared")


def test_one_file_is_prepared_with_the_token_tails_of_the_in_memory_run(tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus", documents=2)  # 2 documents and an empty one: too few to hold out
    section = TextSection(paths=[str(corpus)], val_fraction=0.1)
    assert main(["data", "prepare", str(tmp_path / "prepared"), str(corpus), "--val-fraction", "0.1"]) == 0
    assert "validation token tail, the last 0.1 of each of 3 documents" in capsys.readouterr().out
    prepared, in_memory = open_prepared(tmp_path / "prepared"), load_corpus(section, seed=0)
    for split in ("train", "validation"):
        ours, theirs = getattr(prepared, split), getattr(in_memory, split)
        assert np.array_equal(ours.lengths, theirs.lengths) and len(ours) == 2
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert prepared.split == in_memory.split


def _tokenizer(folder):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    special = ["[UNK]", "<pad>", "<s>", "</s>"]
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=special)
    word_level.train_from_iterator([" ".join(WORDS) + " ."], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return fast


def test_a_run_on_prepared_shards_resumes_exactly_and_saves_its_tokenizer(tmp_path, capsys):
    tokenizer = _tokenizer(tmp_path / "tok")
    corpus = _corpus(tmp_path / "corpus")
    assert main(["data", "prepare", str(tmp_path / "prepared"), str(corpus), "--tokenizer", str(tmp_path / "tok"),
                 "--val-fraction", "0.2"]) == 0
    assert "data.text.prepared=" in capsys.readouterr().out

    def config(name, *extra):
        return load_config(overrides=[
            "data.task=text", f"data.text.prepared={tmp_path / 'prepared'}", "data.tokens_per_batch=32",
            "model.hidden_size=16", "model.layer_pattern=LN", "schedule.steps=6", "schedule.warmup_steps=1",
            "run.save_every=2", "run.log_every=1", "run.progress=false", "run.tensorboard=false",
            f"run.out_dir={tmp_path / name}", *extra])

    whole = Trainer(config("whole")).train()
    assert Trainer(config("cut")).train(stop_at=5).steps == 5  # a crash after step 5; checkpoint at 4
    resumed = Trainer(config("cut")).train()
    assert sorted(resumed.losses) == [5, 6] and all(resumed.losses[s] == whole.losses[s] for s in (5, 6))
    assert "val_loss" in whole.metrics
    model_dir = tmp_path / "whole" / "model"
    assert (model_dir / "tokenizer.json").exists()
    saved = json.loads((model_dir / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    text = load_run(tmp_path / "whole").generate("the cat", max_new_tokens=3, temperature=0)
    assert text.startswith("the cat")


def _overwrite_in_place(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _train_args(tmp_path, name, steps=4):
    return ["train", "data.task=text", f"data.text.prepared={tmp_path / 'prepared'}", "data.tokens_per_batch=32",
            "model.hidden_size=16", "model.layer_pattern=L", f"schedule.steps={steps}", "schedule.warmup_steps=1",
            "run.save_every=2", "run.progress=false", "run.tensorboard=false", f"run.out_dir={tmp_path / name}"]


def test_a_shard_changed_in_place_is_refused_at_start_resume_and_evaluation(tmp_path, capsys):
    section = TextSection(paths=[str(_corpus(tmp_path / "corpus"))], val_fraction=0.2)
    manifest = prepare_corpus(section, tmp_path / "prepared", shard_tokens=300)
    shards = {split: [tmp_path / "prepared" / s["tokens_file"] for s in manifest["splits"][split]["shards"]]
              for split in ("train", "validation")}
    first, last = shards["train"][0], shards["train"][-1]
    original = first.read_bytes()
    _overwrite_in_place(first, 10, b"\x01\x00\x02\x00")  # 4 bytes, two valid token ids: the same size
    assert first.stat().st_size == len(original)
    assert main(_train_args(tmp_path, "four-bytes")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokens_train_00000.bin does not match its SHA-256 sum" in err, err
    first.write_bytes(original)
    assert main(_train_args(tmp_path, "run", steps=2)) == 0  # intact again: trains, checkpoint at step 2
    capsys.readouterr()
    last.write_bytes(bytes([ord("a"), 0]) * (last.stat().st_size // 2))  # the whole shard one valid token
    assert main(_train_args(tmp_path, "run", steps=4)) == 2  # the resume refuses it
    assert f"{last.name} does not match its SHA-256 sum" in capsys.readouterr().err
    validation = shards["validation"][0]
    validation.write_bytes(bytes(reversed(validation.read_bytes())))
    with pytest.raises(DataError, match=validation.name):
        load_run(tmp_path / "run").task  # evaluation reads the validation split: checked


def test_a_long_verification_reports_its_progress_and_rate(tmp_path, caplog, monkeypatch):
    from linmem.data import prepared

    prepare_corpus(TextSection(paths=[str(_corpus(tmp_path / "corpus"))]), tmp_path / "prepared", shard_tokens=300)
    with caplog.at_level("INFO", logger="linmem.train"):
        prepared.verify_prepared(tmp_path / "prepared")
    assert "SHA-256" not in caplog.text  # a small folder: silent
    monkeypatch.setattr(prepared, "VERIFY_REPORT_BYTES", 0)
    monkeypatch.setattr(prepared, "VERIFY_REPORT_SECONDS", 0.0)
    with caplog.at_level("INFO", logger="linmem.train"):
        prepared.verify_prepared(tmp_path / "prepared")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("checking 0.0 GB in ") and "against their SHA-256 sums" in lines[0]
    assert any(line.startswith("checked ") for line in lines) and "files match their SHA-256 sums" in lines[-1]
