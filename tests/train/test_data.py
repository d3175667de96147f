"""Data pipeline: exact resume, packing invariants, text sources, local HF datasets and tokenizers."""

import json
import logging
import sys
from itertools import islice

import numpy as np
import pytest
import torch

import linmem.data.sources as sources
from linmem.data.batches import ExampleBatches, PackedBatches
from linmem.data.codec import byte_detokenize, byte_tokenize, load_tokenizer, tokenize_documents
from linmem.data.config import TextSection
from linmem.data.corpus import load_corpus, split_documents, text_splits
from linmem.data.sources import DataError, FileTexts, load_local_dataset, stdlib_corpus, text_files


def _json_round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def _assert_same_batches(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _resumed(make, total: int, interrupt_at: int):
    """Batches interrupt_at.. of a source rebuilt from the state saved after interrupt_at batches."""
    source = make()
    list(islice(source, interrupt_at))
    state = _json_round_trip(source.state_dict())
    fresh = make()
    fresh.load_state_dict(state)
    return list(islice(fresh, total - interrupt_at))


# ---------------------------------------------------------------- ExampleBatches

def _examples(n=10, length=3):
    inputs = torch.arange(n * length).view(n, length)
    return inputs, -inputs


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("interrupt_at", [1, 2, 5, 8])
def test_example_batches_resume_exactly(drop_last, interrupt_at):
    inputs, labels = _examples()
    make = lambda: ExampleBatches(inputs, labels, 4, seed=3, drop_last=drop_last)  # noqa: E731
    reference = list(islice(make(), 12))
    _assert_same_batches(reference[interrupt_at:], _resumed(make, 12, interrupt_at))


def test_example_batches_epochs_cover_every_example_once():
    inputs, labels = _examples(n=10)
    batches = ExampleBatches(inputs, labels, 4, seed=0, drop_last=False)
    assert batches.batches_per_epoch == 3
    epochs = []
    for _ in range(3):
        epoch = [next(batches) for _ in range(batches.batches_per_epoch)]
        assert [len(b["input_ids"]) for b in epoch] == [4, 4, 2]
        rows = torch.cat([b["input_ids"] for b in epoch])
        assert torch.equal(torch.cat([b["labels"] for b in epoch]), -rows), "labels must stay with their inputs"
        assert sorted(rows[:, 0].tolist()) == inputs[:, 0].tolist()
        epochs.append(rows[:, 0].tolist())
    assert epochs[0] != epochs[1] != epochs[2], "every epoch is reshuffled"


def test_example_batches_drop_last_and_seed():
    inputs, labels = _examples(n=10)
    batches = ExampleBatches(inputs, labels, 4, seed=0)
    assert batches.batches_per_epoch == 2
    assert all(len(b["input_ids"]) == 4 for b in islice(batches, 7))
    first = lambda seed: next(ExampleBatches(inputs, labels, 4, seed=seed))["input_ids"]  # noqa: E731
    assert torch.equal(first(1), first(1)) and not torch.equal(first(1), first(2))


def test_example_batches_reject_bad_input_and_foreign_state():
    inputs, labels = _examples(n=3)
    with pytest.raises(ValueError, match="no full batch"):
        ExampleBatches(inputs, labels, 4, seed=0)
    with pytest.raises(ValueError, match=r"\[N, L\]"):
        ExampleBatches(inputs, labels[:, :2], 2, seed=0)
    state = ExampleBatches(inputs, labels, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="different source"):
        ExampleBatches(inputs, labels, 2, seed=1).load_state_dict(state)


# ---------------------------------------------------------------- PackedBatches

def _documents(seed=0, count=13):
    """Documents of unique, consecutive token ids (0..n-1 overall), some empty, some long."""
    lengths = np.random.default_rng(seed).integers(0, 40, size=count)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [list(range(bounds[i], bounds[i + 1])) for i in range(count)]


def _rows_until(batches, tokens):
    rows = []
    while sum(r["input_ids"].numel() for r in rows) < tokens:
        rows.append(next(batches))
    return rows


def test_packed_rows_have_exact_size_and_consistent_segments():
    docs = _documents()
    T, piece = 16, 10
    doc_of = {t: i for i, d in enumerate(docs) for t in d}
    rows = _rows_until(PackedBatches(docs, T, seed=0, max_document_tokens=piece), 3 * sum(map(len, docs)))
    previous_end = None
    for row in rows:
        ids, cu = row["input_ids"], row["cu_seqlens"]
        assert ids.shape == (1, T) and ids.dtype == torch.int64 and torch.equal(row["labels"], ids)
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T and (cu[1:] > cu[:-1]).all()
        for k, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            seg = ids[0, start:end].tolist()
            assert len(seg) <= piece
            assert seg == list(range(seg[0], seg[0] + len(seg))) and doc_of[seg[0]] == doc_of[seg[-1]]
            offset_in_doc = seg[0] - docs[doc_of[seg[0]]][0]
            continues = k == 0 and previous_end is not None and seg[0] == previous_end + 1
            assert offset_in_doc % piece == 0 or continues, "a segment starts at a piece start or continues a cut piece"
            if end < T:  # a segment inside a row ends where its piece ends
                last_offset = seg[-1] - docs[doc_of[seg[-1]]][0]
                assert (last_offset + 1) % piece == 0 or seg[-1] == docs[doc_of[seg[-1]]][-1]
        previous_end = ids[0, -1].item()


def test_packed_epochs_hold_every_token_once_in_document_order():
    docs = _documents(seed=1)
    total = sum(map(len, docs))
    assert total % 16 != 0
    batches = PackedBatches(docs, 16, seed=5)
    assert batches.tokens_per_epoch == total
    stream = torch.cat([r["input_ids"][0] for r in _rows_until(batches, 3 * total)]).numpy()
    epochs = [stream[e * total:(e + 1) * total] for e in range(3)]
    for epoch in epochs:
        assert np.array_equal(np.sort(epoch), np.arange(total)), "every token once per epoch"
        breaks = np.count_nonzero(np.diff(epoch) != 1)
        assert breaks <= sum(1 for d in docs if d) - 1, "a document's pieces stay together and in order"
    assert not np.array_equal(epochs[0], epochs[1]), "documents are reshuffled each epoch"


def test_packed_long_documents_are_cut_to_the_row():
    batches = PackedBatches([list(range(50))], 8, seed=0)
    rows = [next(batches) for _ in range(7)]
    assert all(r["cu_seqlens"].tolist() in ([0, 8], [0, 2, 8], [0, 6, 8], [0, 4, 8]) for r in rows)
    assert torch.cat([r["input_ids"][0] for r in rows]).tolist()[:50] == list(range(50))


@pytest.mark.parametrize("interrupt_at", [1, 4, 9])
def test_packed_batches_resume_exactly(interrupt_at):
    docs = _documents(seed=2)
    make = lambda: PackedBatches(docs, 16, seed=7, max_document_tokens=6)  # noqa: E731
    reference = list(islice(make(), 20))  # crosses several epochs
    _assert_same_batches(reference[interrupt_at:], _resumed(make, 20, interrupt_at))


def test_packed_accepts_tensors_and_rejects_foreign_state():
    docs = _documents(seed=3)
    from_lists = list(islice(PackedBatches(docs, 16, seed=0), 5))
    from_tensors = list(islice(PackedBatches([torch.tensor(d, dtype=torch.long) for d in docs], 16, seed=0), 5))
    _assert_same_batches(from_lists, from_tensors)
    state = PackedBatches(docs, 16, seed=0).state_dict()
    with pytest.raises(ValueError, match="different source"):
        PackedBatches(docs[:-1], 16, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="no tokens"):
        PackedBatches([[], []], 16, seed=0)


# ---------------------------------------------------------------- text sources

def test_byte_tokenizer_round_trip():
    text = "memory ≈ state, naïve 🙂"
    ids = byte_tokenize(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert byte_detokenize(ids) == text
    assert byte_detokenize(torch.tensor(ids)) == text
    assert byte_detokenize([104, 0xFF, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match="256"):
        byte_detokenize([300])


def test_stdlib_corpus_reads_real_sources():
    corpus = stdlib_corpus(max_files=20)
    assert len(corpus) == 20 and corpus == stdlib_corpus(max_files=20)
    assert all(text.strip() for text in corpus)
    assert sum("def " in text or "import " in text for text in corpus) >= 15


def test_stdlib_corpus_skips_tests_and_site_packages(tmp_path, monkeypatch):
    files = {"b.py": "b = 2\n", "a.py": "a = 1\n", "empty.py": "", "test/test_a.py": "t = 1\n",
             "pkg/tests/t.py": "t = 2\n", "site-packages/p.py": "p = 1\n", "pkg/mod.py": "m = 1\n", "x.txt": "no"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(sources.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert stdlib_corpus() == ["a = 1\n", "b = 2\n", "m = 1\n"]
    assert stdlib_corpus(max_files=2) == ["a = 1\n", "b = 2\n"]


def test_text_files_reads_files_and_folders(tmp_path):
    for name, text in {"a.txt": "A", "b.md": "B", "c.py": "C", "d.bin": "D", ".hidden/e.txt": "E",
                       "sub/f.txt": "F"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    single = tmp_path / "d.bin"
    assert text_files([single, tmp_path]) == ["D", "A", "B", "C", "F"]
    assert text_files([str(tmp_path)], suffixes=(".md",)) == ["B"]
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        text_files([tmp_path / "missing"])


def test_split_documents_is_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(50)]
    train, val = split_documents(docs, 0.2, seed=1)
    assert len(val) == 10 and len(train) == 40
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)], "each split keeps the input order"
    assert (train, val) == split_documents(docs, 0.2, seed=1)
    assert val != split_documents(docs, 0.2, seed=2)[1]
    assert split_documents(docs, 0.0, seed=0) == (docs, [])
    assert len(split_documents(docs[:3], 0.01, seed=0)[1]) == 1
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(docs, 1.0, seed=0)


# ---------------------------------------------------------------- local Hugging Face data

@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    datasets.disable_progress_bars()
    return datasets


TEXTS = ["the cat sat", "on the mat", "a dog ran"]


def test_load_jsonl_and_parquet_files(tmp_path, hf_datasets):
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)))
    assert load_local_dataset(jsonl) == TEXTS
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    hf_datasets.Dataset.from_dict({"body": TEXTS}).to_parquet(str(parquet_dir / "part-0.parquet"))
    assert load_local_dataset(parquet_dir, text_field="body") == TEXTS
    assert load_local_dataset(parquet_dir / "part-0.parquet", text_field="body", split="train[:2]") == TEXTS[:2]
    with pytest.raises(ValueError, match="text_field"):
        load_local_dataset(jsonl, text_field="content")


def test_load_save_to_disk_folders(tmp_path, hf_datasets):
    single = hf_datasets.Dataset.from_dict({"text": TEXTS})
    single.save_to_disk(str(tmp_path / "single"))
    assert load_local_dataset(tmp_path / "single") == TEXTS
    splits = hf_datasets.DatasetDict({"train": single, "validation": hf_datasets.Dataset.from_dict({"text": ["x"]})})
    splits.save_to_disk(str(tmp_path / "splits"))
    assert load_local_dataset(tmp_path / "splits", split="validation") == ["x"]
    with pytest.raises(ValueError, match="split 'test'"):
        load_local_dataset(tmp_path / "splits", split="test")


def test_load_local_dataset_errors(tmp_path, hf_datasets, monkeypatch):
    with pytest.raises(FileNotFoundError, match="only local paths"):
        load_local_dataset(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a save_to_disk folder"):
        load_local_dataset(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_local_dataset(tmp_path)


def _save_tiny_tokenizer(folder):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word_level.train_from_iterator(TEXTS, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return word_level


def test_local_tokenizer_loads_and_tokenizes(tmp_path):
    word_level = _save_tiny_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    eos = word_level.token_to_id("</s>")
    assert tokenizer.eos_token_id == eos
    docs = tokenize_documents(TEXTS[:2], tokenizer)
    assert docs == [word_level.encode(t).ids + [eos] for t in TEXTS[:2]]
    assert tokenize_documents(["the zebra"], tokenizer, add_eos=False) == [[word_level.token_to_id("the"), 0]]
    batch = next(PackedBatches(docs, 4, seed=0))
    assert batch["input_ids"].shape == (1, 4)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------- faults of real corpora

def _write(folder, files):
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return folder


def test_empty_documents_are_skipped_and_counted_and_an_empty_split_is_refused(tmp_path, caplog):
    docs = {f"d{i}.txt": f"document {i} " * 5 for i in range(6)}
    corpus = _write(tmp_path / "corpus", {**docs, "__init__.py": "", "pkg/__init__.py": ""})
    with caplog.at_level(logging.INFO, logger="linmem.train"):
        loaded = load_corpus(TextSection(paths=[str(corpus)], val_fraction=0.25), seed=0)
    counts = loaded.counts
    assert counts["train"].empty + counts["validation"].empty == 2
    assert len(loaded.train) + len(loaded.validation) == 6 and all(loaded.train.lengths > 0)
    assert "skipped" in caplog.text and "empty document" in caplog.text
    only_empty = _write(tmp_path / "empty", {"a.txt": "", "b.txt": ""})
    with pytest.raises(DataError, match=r"the train split of .*empty holds no tokens \(2 empty documents"):
        load_corpus(TextSection(paths=[str(only_empty)], val_fraction=0.0), seed=0)
    one = _write(tmp_path / "one", {"a.txt": "text"})
    with pytest.raises(DataError, match=r"the validation split .* holds no tokens .*data.text.val_fraction=0"):
        load_corpus(TextSection(paths=[str(one)], val_fraction=0.1), seed=0)  # a tail of 0.4 of 4 tokens
    assert len(load_corpus(TextSection(paths=[str(one)], val_fraction=0.0), seed=0).validation) == 0


def test_too_few_documents_are_split_by_their_token_tails(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(40))
    one = _write(tmp_path / "one", {"book.txt": text})
    corpus = load_corpus(TextSection(paths=[str(one)], val_fraction=0.1), seed=0)
    tail = round(len(text) * 0.1)
    assert corpus.split.startswith("token tail, the last 0.1 of each of 1 document")
    assert byte_detokenize(corpus.train[0]) == text[:-tail] and byte_detokenize(corpus.validation[0]) == text[-tail:]
    two = _write(tmp_path / "two", {"a.txt": text, "b.txt": text[:200], "empty.txt": ""})  # 2% of 3 rounds to 0
    corpus = load_corpus(TextSection(paths=[str(two)]), seed=0)
    assert corpus.validation.lengths.tolist() == [round(len(text) * 0.02), round(200 * 0.02)]
    assert corpus.train.num_tokens + corpus.validation.num_tokens == len(text) + 200
    assert corpus.counts["train"].empty == 1
    many = _write(tmp_path / "many", {f"d{i}.txt": text for i in range(50)})  # 2% of 50: one document held out
    corpus = load_corpus(TextSection(paths=[str(many)]), seed=0)
    assert corpus.split == "documents, 1 of 50 held out" and corpus.validation.lengths.tolist() == [len(text)]


def test_invalid_utf8_is_counted_or_refused(tmp_path, caplog):
    corpus = _write(tmp_path, {"a.txt": b"caf\xe9 au lait", "b.txt": "ok"})
    with caplog.at_level(logging.WARNING, logger="linmem.train"):
        assert list(FileTexts([corpus / "a.txt", corpus / "b.txt"])) == ["caf\ufffd au lait", "ok"]
    assert "1 of 2 files held invalid UTF-8" in caplog.text and "a.txt" in caplog.text
    with pytest.raises(DataError, match=r"a.txt is not valid UTF-8 \(byte 3\)"):
        list(FileTexts([corpus / "a.txt"], errors="strict"))


def test_malformed_files_are_named(tmp_path, hf_datasets):
    bad_json = _write(tmp_path, {"bad.jsonl": '{"text": "a"}\n{"text": \n'}) / "bad.jsonl"
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not valid JSON"):
        load_local_dataset(bad_json)
    folder = tmp_path / "saved"
    hf_datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(folder))
    (folder / "state.json").write_text("{broken")
    with pytest.raises(DataError, match=r"cannot load the dataset folder .*saved"):
        load_local_dataset(folder)
    tokenizer = _write(tmp_path / "tok", {"tokenizer.json": "{not json", "tokenizer_config.json": "{}"})
    with pytest.raises(DataError, match=r"cannot load a tokenizer from .*tok"):
        load_tokenizer(tokenizer)


def test_a_dataset_dict_with_a_validation_split_uses_it(tmp_path, hf_datasets):
    held_out = ["held out one", "held out two"]
    hf_datasets.DatasetDict({"train": hf_datasets.Dataset.from_dict({"text": TEXTS}),
                             "validation": hf_datasets.Dataset.from_dict({"text": held_out})}
                            ).save_to_disk(str(tmp_path / "splits"))
    splits = text_splits(TextSection(dataset=str(tmp_path / "splits"), tokenizer="unused"), seed=0)
    assert list(splits.train) == TEXTS and list(splits.validation) == held_out
    assert splits.how == "the dataset's 'validation' split"
