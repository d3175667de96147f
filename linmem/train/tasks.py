"""What a run learns and how it is scored: MQAR recall, language modelling on text, or instruction tuning.

A task owns its training batches (resumable iterators), its vocabulary and its
evaluation; the trainer knows nothing else about data.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from ..data.batches import Batch, ExampleBatches, PackedBatches
from ..data.codec import Codec, load_codec
from ..data.config import DataSection
from ..data.corpus import counted, load_corpus, section_codec
from ..data.instruct import InstructBatches, encode_examples, predicted_answer_tokens, read_records, rows_in_order
from ..data.mqar import mqar_hits, shift_labels_right
from ..data.mqar_variants import mqar_generator
from ..data.prepared import open_prepared, verify_prepared

EVAL_SEED_OFFSET = 1_000_003  # evaluation examples never share the training seeds


class RoundRobin:
    """Cycle through several resumable batch sources, one batch from each in turn."""

    def __init__(self, sources: Sequence[Any]) -> None:
        self.sources = list(sources)
        self.turn = 0

    def __iter__(self) -> Iterator[Batch]:
        iterators = [iter(s) for s in self.sources]
        while True:
            batch = next(iterators[self.turn])
            self.turn = (self.turn + 1) % len(self.sources)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.turn = state["turn"]
        for source, sub in zip(self.sources, state["sources"]):
            source.load_state_dict(sub)


class Task(ABC):
    vocab_size: int
    train_batches: Any  # iterable of Batch with state_dict / load_state_dict
    codec: Optional[Codec] = None  # text tasks: how text becomes tokens (saved with the model)

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, device: torch.device, progress: bool = False) -> dict[str, float]:
        """Metrics of ``model`` on held-out data (with a progress bar of its own if ``progress``)."""

    def describe(self) -> str:
        return type(self).__name__


class MQARTask(Task):
    """Multi-query associative recall (``data.mqar.variant``), trained on a mix of (seq_len, kv pairs) settings."""

    def __init__(self, data: DataSection) -> None:
        m = data.mqar
        generate = mqar_generator(m.variant, update_fraction=m.update_fraction, num_blocks=m.num_blocks)
        self.variant = m.variant
        self.vocab_size = m.vocab_size
        self.batch_size = data.batch_size
        sources = []
        for i, (seq_len, kv) in enumerate(m.settings):
            x, y = generate(m.train_examples, seq_len, kv, m.vocab_size, power_a=m.power_a,
                            seed=data.seed * 1000 + i)
            # Zoology labels sit at the query position; the model's loss shifts labels by one
            sources.append(ExampleBatches(x, shift_labels_right(y), data.batch_size, seed=data.seed * 1000 + i))
        self.train_batches = RoundRobin(sources)
        self.eval_sets = {}
        for i, (seq_len, kv) in enumerate(m.eval_settings or m.settings):
            self.eval_sets[(seq_len, kv)] = generate(m.eval_examples, seq_len, kv, m.vocab_size,
                                                     power_a=m.power_a, seed=EVAL_SEED_OFFSET + data.seed * 1000 + i)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device, progress: bool = False) -> dict[str, float]:
        metrics = {}
        bar = _EvalProgress(sum(-(-len(x) // self.batch_size) for x, _ in self.eval_sets.values()), progress)
        for (seq_len, kv), (x, y) in self.eval_sets.items():
            correct = total = 0
            for start in bar.wrap(range(0, len(x), self.batch_size)):
                xb, yb = x[start : start + self.batch_size].to(device), y[start : start + self.batch_size].to(device)
                logits = model(input_ids=xb, use_cache=False).logits.float()
                hits, n = mqar_hits(logits, yb)
                correct, total = correct + hits, total + n
            metrics[f"mqar_acc/L{seq_len}_kv{kv}"] = correct / max(total, 1)
        bar.close()
        return metrics

    def describe(self) -> str:
        return f"MQAR ({self.variant}) settings {list(self.eval_sets)} vocab {self.vocab_size}"


class TextTask(Task):
    """Next-token prediction on local text (bytes by default), scored by perplexity.

    The documents come from a prepared folder (``data.text.prepared``, memory-mapped) or are
    read and tokenized into memory (:func:`~linmem.data.corpus.load_corpus`).
    """

    def __init__(self, data: DataSection) -> None:
        t = data.text
        if t.prepared is not None:
            corpus: Any = open_prepared(t.prepared)
        else:
            corpus = load_corpus(t, data.seed)
        self.codec, self.vocab_size = corpus.codec, corpus.codec.vocab_size
        self.source, self.split, self.val_docs = corpus.source, corpus.split, corpus.validation
        self.tokens_per_batch, self.max_document_tokens = data.tokens_per_batch, data.max_document_tokens
        self.train_tokens, self.train_documents = corpus.train.num_tokens, len(corpus.train)
        self.train_batches = PackedBatches(corpus.train, data.tokens_per_batch, seed=data.seed,
                                           max_document_tokens=data.max_document_tokens)

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device, progress: bool = False) -> dict[str, float]:
        if len(self.val_docs) == 0:
            return {}
        batches = PackedBatches(self.val_docs, self.tokens_per_batch, seed=0,
                                max_document_tokens=self.max_document_tokens)
        count = max(1, self.val_docs.num_tokens // self.tokens_per_batch)
        total_loss = total_tokens = 0.0
        bar = _EvalProgress(count, progress)
        for _, batch in bar.wrap(zip(range(count), batches)):
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch, use_cache=False)
            predicted = _predicted_tokens(batch["labels"], batch.get("cu_seqlens"))
            total_loss += float(out.loss) * predicted
            total_tokens += predicted
        bar.close()
        loss = total_loss / max(total_tokens, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def describe(self) -> str:
        """The source, how it was split and how many tokens each side, e.g. ``text from corpus.txt; validation:
        token tail, the last 0.02 of each of 1 document (...); 9,800 training tokens in 1 document, 200
        validation tokens in 1 document; vocab 256``."""
        return (f"text from {self.source}; validation: {self.split}; {self.train_tokens:,} training tokens in "
                f"{counted(self.train_documents, 'document')}, {self.val_docs.num_tokens:,} validation tokens in "
                f"{counted(len(self.val_docs), 'document')}; vocab {self.vocab_size}")


class _EvalProgress:
    """A tqdm bar named "eval" around an iterable, or nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, disable=not enabled, desc="eval", unit="batch", dynamic_ncols=True, leave=False)

    def wrap(self, iterable):
        for item in iterable:
            yield item
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class InstructTask(Task):
    """Instruction tuning on a local Alpaca-style file, scored by the loss of the answer tokens of held-out
    examples (``val_loss``, ``val_ppl``)."""

    def __init__(self, data: DataSection) -> None:
        section = data.instruct
        self.codec = load_codec(section.tokenizer)
        self.vocab_size = self.codec.vocab_size
        tokenizer = self.codec.tokenizer
        records = read_records(Path(section.path))
        order = np.random.default_rng(data.seed).permutation(len(records))
        held_out = int(round(len(records) * section.val_fraction))
        max_tokens = min(section.max_tokens, data.tokens_per_batch)
        self.train_examples = encode_examples([records[i] for i in order[held_out:]], tokenizer, max_tokens)
        self.val_examples = (encode_examples([records[i] for i in order[:held_out]], tokenizer, max_tokens)
                             if held_out else None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id, self.tokens_per_batch, self.source = pad, data.tokens_per_batch, section.path
        self.train_batches = InstructBatches(self.train_examples, data.tokens_per_batch, pad_id=pad, seed=data.seed)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device, progress: bool = False) -> dict[str, float]:
        if self.val_examples is None:
            return {}
        total_loss = total = 0.0
        for row in rows_in_order(self.val_examples, self.tokens_per_batch, self.pad_id):
            batch = {k: v.to(device) for k, v in row.items()}
            count = predicted_answer_tokens(batch["labels"], batch["cu_seqlens"])
            if count:
                total_loss += float(model(**batch, use_cache=False).loss) * count
                total += count
        loss = total_loss / max(total, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def describe(self) -> str:
        answers = sum(len(t) - p for t, p in zip(self.train_examples.tokens, self.train_examples.prompt_lengths))
        held_out = len(self.val_examples) if self.val_examples is not None else 0
        return (f"instructions ({self.source}): {len(self.train_examples):,} examples ({answers:,} answer tokens), "
                f"{held_out:,} held out, vocab {self.vocab_size}")


def _predicted_tokens(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    """How many positions the loss averages over (shifted labels, packed boundaries removed)."""
    n = int((labels[:, 1:] != -100).sum())
    if cu_seqlens is not None:
        n -= int(((cu_seqlens[1:-1] > 0) & (cu_seqlens[1:-1] < labels.shape[1])).sum())
    return n


def build_task(data: DataSection) -> Task:
    if data.task == "instruct":
        return InstructTask(data)
    return MQARTask(data) if data.task == "mqar" else TextTask(data)


def verify_text_shards(data: DataSection, splits: Sequence[str] = ("train", "validation")) -> None:
    """Hash the prepared shards of ``splits`` that ``data`` trains on against their manifest's SHA-256
    sums (:func:`~linmem.data.prepared.verify_prepared`); nothing for other data."""
    if data.task == "text" and data.text.prepared is not None:
        verify_prepared(data.text.prepared, splits)


def text_codec(data: DataSection, model_dir: Path) -> Codec:
    """How a saved text run turns text into tokens, without reading its corpus: the tokenizer
    saved in ``model_dir``, else the prepared folder's, else the section's (a tokenizer or bytes)."""
    if (model_dir / "tokenizer_config.json").exists():
        return load_codec(model_dir)
    if data.text.prepared is not None:
        return open_prepared(data.text.prepared).codec
    return section_codec(data.text)
