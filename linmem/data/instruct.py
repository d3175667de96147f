"""Instruction tuning data: Alpaca-style records from a local JSON or JSONL file, prompt-masked and packed.

A record ``{"instruction": str, "input": str (optional), "output": str}`` becomes one example::

    prompt  = ALPACA_PROMPT with the fields filled in (ALPACA_PROMPT_NO_INPUT when input is empty)
    tokens  = tokenizer(prompt) + tokenizer(output, no special tokens) + [EOS]
    labels  = -100 on the prompt's tokens (only the answer and its EOS are learnt), the tokens elsewhere

The prompt keeps the tokenizer's own special tokens (a Llama tokenizer's BOS). An example is cut to
``max_tokens`` (its prompt first: one whose prompt fills it has nothing to learn and is dropped).
Examples are packed whole into rows of exactly ``tokens_per_batch`` tokens, each its own sequence
(``cu_seqlens``); the rest of a row is one padding sequence with labels -100. A source is resumable
(``state_dict``), its epochs shuffled by (seed, epoch). A file that cannot be read as records raises
:class:`~linmem.data.sources.DataError` naming the file and the record.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from .batches import Batch, _check_state, _epoch_rng
from .sources import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("linmem.train")

#: the Stanford Alpaca prompt of a record with an input
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
#: the Stanford Alpaca prompt of a record without one
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. "
                          "Write a response that appropriately completes the request.\n\n"
                          "### Instruction:\n{instruction}\n\n### Response:\n")
IGNORE = -100


def read_records(path: Path) -> list[dict[str, str]]:
    """The records of a JSON list or a JSONL file, each with string ``instruction`` and ``output`` (and
    optionally ``input``).

    Example:
        >>> read_records(Path("alpaca_data.json"))[0]["instruction"]  # doctest: +SKIP
        'Give three tips for staying healthy.'
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"instruction data {path} not found")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid {'JSONL' if path.suffix == '.jsonl' else 'JSON'}: {err}") from err
    if not isinstance(records, list) or not records:
        raise DataError(f"{path} must hold a non-empty list of records (a JSON array, or one object per JSONL line)")
    for i, record in enumerate(records):
        fields = ("instruction", "output")
        if not isinstance(record, dict) or any(not isinstance(record.get(f), str) for f in fields) or \
                not isinstance(record.get("input", ""), str):
            raise DataError(f"{path}: record {i} must be an object with string 'instruction' and 'output' "
                            f"(and optionally 'input'), got {str(record)[:120]!r}")
    return records


def format_prompt(record: dict[str, str]) -> str:
    """The Alpaca prompt of a record (its ``input`` filled in when not empty).

    Example:
        >>> format_prompt({"instruction": "Add 2 and 3.", "output": "5"}).splitlines()[-3:]
        ['Add 2 and 3.', '', '### Response:']
    """
    if record.get("input", "").strip():
        return ALPACA_PROMPT.format(instruction=record["instruction"], input=record["input"])
    return ALPACA_PROMPT_NO_INPUT.format(instruction=record["instruction"])


@dataclass
class InstructExamples:
    """Tokenized examples: ``tokens[i]`` (int64) of which the first ``prompt_lengths[i]`` are the prompt."""

    tokens: list[np.ndarray]
    prompt_lengths: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def labels(self, i: int) -> np.ndarray:
        """The labels of example i: its tokens, -100 on the prompt."""
        labels = self.tokens[i].copy()
        labels[: self.prompt_lengths[i]] = IGNORE
        return labels


def encode_examples(records: Sequence[dict[str, str]], tokenizer: "PreTrainedTokenizerBase",
                    max_tokens: int) -> InstructExamples:
    """Records -> prompt-masked examples of at most ``max_tokens`` tokens (those with no answer token left
    are dropped, and counted in the log)."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token: the model could not learn where an answer ends")
    prompts = tokenizer([format_prompt(r) for r in records])["input_ids"]
    answers = tokenizer([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    tokens, prompt_lengths, dropped = [], [], 0
    for prompt, answer in zip(prompts, answers):
        if len(prompt) >= max_tokens:
            dropped += 1
            continue
        ids = (list(prompt) + list(answer) + [tokenizer.eos_token_id])[:max_tokens]
        tokens.append(np.asarray(ids, dtype=np.int64))
        prompt_lengths.append(len(prompt))
    if dropped:
        logger.info("instruction data: %d of %d examples dropped (prompt of %d tokens or more)", dropped,
                    len(records), max_tokens)
    if not tokens:
        raise DataError(f"no example keeps an answer token within max_tokens = {max_tokens}")
    return InstructExamples(tokens, prompt_lengths)


def pack_row(examples: InstructExamples, indices: Sequence[int], tokens_per_batch: int, pad_id: int) -> Batch:
    """Examples ``indices`` (fitting in one row) packed into a row of ``tokens_per_batch`` tokens, the rest
    one padding sequence: ``input_ids [1, T]``, ``labels [1, T]``, ``cu_seqlens [N + 1]`` int32."""
    ids = [examples.tokens[i] for i in indices]
    labels = [examples.labels(i) for i in indices]
    rest = tokens_per_batch - sum(len(t) for t in ids)
    if rest:
        ids.append(np.full(rest, pad_id, dtype=np.int64))
        labels.append(np.full(rest, IGNORE, dtype=np.int64))
    cu_seqlens = torch.tensor([0] + [len(t) for t in ids], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return {"input_ids": torch.from_numpy(np.concatenate(ids))[None],
            "labels": torch.from_numpy(np.concatenate(labels))[None], "cu_seqlens": cu_seqlens}


def rows_in_order(examples: InstructExamples, tokens_per_batch: int, pad_id: int) -> Iterator[Batch]:
    """Every example once, in order, packed greedily into rows (as :class:`InstructBatches` packs)."""
    chosen, filled = [], 0
    for index, tokens in enumerate(examples.tokens):
        if filled + len(tokens) > tokens_per_batch:
            yield pack_row(examples, chosen, tokens_per_batch, pad_id)
            chosen, filled = [], 0
        chosen.append(index)
        filled += len(tokens)
    yield pack_row(examples, chosen, tokens_per_batch, pad_id)


class InstructBatches:
    """Whole examples packed into rows of exactly ``tokens_per_batch`` tokens, infinite over epochs.

    Batches are ``input_ids [1, T]``, ``labels [1, T]`` (-100 on prompts and padding) and ``cu_seqlens
    [N + 1]`` int32 (one sequence per example, and the padding at the end of a row as one more).

    Example:
        >>> examples = InstructExamples([np.arange(1, 4), np.arange(5, 7)], [1, 1])
        >>> batch = next(InstructBatches(examples, 8, pad_id=0, seed=0))
        >>> batch["input_ids"].shape, batch["cu_seqlens"].tolist()[-1]
        (torch.Size([1, 8]), 8)
    """

    def __init__(self, examples: InstructExamples, tokens_per_batch: int, *, pad_id: int, seed: int) -> None:
        too_long = [i for i, t in enumerate(examples.tokens) if len(t) > tokens_per_batch]
        if too_long:
            raise ValueError(f"example {too_long[0]} has {len(examples.tokens[too_long[0]])} tokens, more than a row "
                             f"of tokens_per_batch = {tokens_per_batch}")
        if not len(examples):
            raise ValueError("no examples to pack")
        self.examples, self.tokens_per_batch, self.pad_id = examples, tokens_per_batch, pad_id
        self.seed = seed
        self.epoch, self.position = 0, 0

    def __iter__(self) -> "InstructBatches":
        return self

    def _order(self, epoch: int) -> np.ndarray:
        return _epoch_rng(self.seed, epoch).permutation(len(self.examples))

    def __next__(self) -> Batch:
        chosen, filled = [], 0
        while True:
            order = self._order(self.epoch)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            index = int(order[self.position])
            if filled + len(self.examples.tokens[index]) > self.tokens_per_batch:
                break
            chosen.append(index)
            filled += len(self.examples.tokens[index])
            self.position += 1
        return pack_row(self.examples, chosen, self.tokens_per_batch, self.pad_id)

    def _settings(self) -> dict:
        return {"kind": "InstructBatches", "seed": self.seed, "num_examples": len(self.examples),
                "tokens_per_batch": self.tokens_per_batch}

    def state_dict(self) -> dict:
        """Settings and position: {"kind", "seed", "num_examples", "tokens_per_batch", "epoch", "position"}."""
        return {**self._settings(), "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the batch after the one where ``state`` was taken (same examples and settings)."""
        _check_state(state, self._settings(), ("epoch", "position"))
        if int(state["epoch"]) < 0 or not 0 <= int(state["position"]) <= len(self.examples):
            raise ValueError(f"state_dict position out of range: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def predicted_answer_tokens(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    """How many targets the model's loss averages over: labels [1, T] shifted by one, less those that
    would cross a sequence boundary."""
    targets = labels[:, 1:].clone()
    ends = cu_seqlens[1:-1].long() - 1
    targets[0, ends[(ends >= 0) & (ends < targets.shape[1])]] = IGNORE
    return int((targets != IGNORE).sum())
