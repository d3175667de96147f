"""What a run learns and how it is scored: MQAR recall or language modelling on text.

A task owns its training batches (resumable iterators), its vocabulary and its
evaluation; the trainer knows nothing else about data.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..eval.mqar import generate_mqar, mqar_hits, shift_labels_right
from .config import DataSection
from .data import (ExampleBatches, PackedBatches, byte_detokenize, byte_tokenize, load_local_dataset,
                   load_tokenizer, split_documents, stdlib_corpus, text_files, tokenize_documents)

Batch = dict[str, torch.Tensor]
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

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics of ``model`` on held-out data."""

    def describe(self) -> str:
        return type(self).__name__


class MQARTask(Task):
    """Multi-query associative recall, trained on a mix of (seq_len, kv pairs) settings."""

    def __init__(self, data: DataSection) -> None:
        m = data.mqar
        self.vocab_size = m.vocab_size
        self.batch_size = data.batch_size
        sources = []
        for i, (seq_len, kv) in enumerate(m.settings):
            x, y = generate_mqar(m.train_examples, seq_len, kv, m.vocab_size, power_a=m.power_a,
                                 seed=data.seed * 1000 + i)
            # Zoology labels sit at the query position; the model's loss shifts labels by one
            sources.append(ExampleBatches(x, shift_labels_right(y), data.batch_size, seed=data.seed * 1000 + i))
        self.train_batches = RoundRobin(sources)
        self.eval_sets = {}
        for i, (seq_len, kv) in enumerate(m.eval_settings or m.settings):
            self.eval_sets[(seq_len, kv)] = generate_mqar(m.eval_examples, seq_len, kv, m.vocab_size,
                                                          power_a=m.power_a, seed=EVAL_SEED_OFFSET + data.seed * 1000 + i)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        metrics = {}
        for (seq_len, kv), (x, y) in self.eval_sets.items():
            correct = total = 0
            for start in range(0, len(x), self.batch_size):
                xb, yb = x[start : start + self.batch_size].to(device), y[start : start + self.batch_size].to(device)
                logits = model(input_ids=xb, use_cache=False).logits.float()
                hits, n = mqar_hits(logits, yb)
                correct, total = correct + hits, total + n
            metrics[f"mqar_acc/L{seq_len}_kv{kv}"] = correct / max(total, 1)
        return metrics

    def describe(self) -> str:
        return f"MQAR settings {list(self.eval_sets)} vocab {self.vocab_size}"


class TextTask(Task):
    """Next-token prediction on local text (bytes by default), scored by perplexity."""

    def __init__(self, data: DataSection) -> None:
        t = data.text
        if t.dataset is not None:
            texts = load_local_dataset(t.dataset, text_field=t.text_field)
        elif t.paths:
            texts = text_files(t.paths)
        else:
            texts = stdlib_corpus(max_files=t.max_files)
        if t.paths and t.max_files is not None:
            texts = texts[: t.max_files]
        if not texts:
            raise ValueError("the text corpus is empty: check data.text.paths / data.text.dataset")
        if t.tokenizer is not None:
            tokenizer = load_tokenizer(t.tokenizer)
            self.vocab_size = len(tokenizer)
            docs = tokenize_documents(texts, tokenizer)
            self.decode: Callable[[Sequence[int]], str] = lambda ids: tokenizer.decode(list(ids))
            self.encode: Callable[[str], list[int]] = lambda s: tokenizer(s)["input_ids"]
        else:
            self.vocab_size = 256
            docs = [byte_tokenize(s) for s in texts]
            self.decode, self.encode = byte_detokenize, byte_tokenize
        train_docs, self.val_docs = split_documents(docs, t.val_fraction, data.seed)
        self.tokens_per_batch = data.tokens_per_batch
        self.train_tokens = sum(len(d) for d in train_docs)
        self.train_batches = PackedBatches(train_docs, data.tokens_per_batch, seed=data.seed,
                                           max_document_tokens=data.max_document_tokens)
        self.max_document_tokens = data.max_document_tokens

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        if not self.val_docs:
            return {}
        batches = PackedBatches(self.val_docs, self.tokens_per_batch, seed=0,
                                max_document_tokens=self.max_document_tokens)
        count = max(1, sum(len(d) for d in self.val_docs) // self.tokens_per_batch)
        total_loss = total_tokens = 0.0
        for _, batch in zip(range(count), batches):
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch, use_cache=False)
            predicted = _predicted_tokens(batch["labels"], batch.get("cu_seqlens"))
            total_loss += float(out.loss) * predicted
            total_tokens += predicted
        loss = total_loss / max(total_tokens, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def describe(self) -> str:
        return f"text: {self.train_tokens:,} training tokens, {len(self.val_docs)} held-out documents, vocab {self.vocab_size}"


def _predicted_tokens(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    """How many positions the loss averages over (shifted labels, packed boundaries removed)."""
    n = int((labels[:, 1:] != -100).sum())
    if cu_seqlens is not None:
        n -= int(((cu_seqlens[1:-1] > 0) & (cu_seqlens[1:-1] < labels.shape[1])).sum())
    return n


def build_task(data: DataSection) -> Task:
    return MQARTask(data) if data.task == "mqar" else TextTask(data)
