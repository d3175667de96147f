"""The ``data`` section of a training config: what a model learns (MQAR, local text, instruction data).

Plain dataclasses whose fields carry their meaning (:mod:`linmem.settings`); :class:`DataSection` is
``TrainConfig.data`` (:mod:`linmem.train.config`), validated there. Nothing here imports torch.

Example:
    >>> DataSection().text.val_fraction
    0.02
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..settings import section, setting

#: The default share of text held out for validation (``data.text.val_fraction``).
VAL_FRACTION = 0.02


@dataclass
class MQARSection:
    settings: list[list[int]] = setting([[64, 4]], "(seq_len, kv pairs) trained on, mixed")
    eval_settings: list[list[int]] = setting([], "evaluated on (empty: the trained ones)")
    vocab_size: int = setting(8192, "tokens (base: keys from [1, V/2), values from [V/2, V); other variants: one "
                                    "pool [1, V))")
    train_examples: int = setting(20000, "training examples per setting")
    eval_examples: int = setting(1000, "evaluation examples per setting")
    power_a: float = setting(0.01, "power-law parameter of query gaps")
    variant: str = setting("base", "base (Zoology), shared (keys and values from one pool), update (keys rebound), "
                                   "block")
    update_fraction: float = setting(0.5, "variant update: fraction of the pairs rebound (at least one)")
    num_blocks: int = setting(2, "variant block: MQAR examples back to back in one sequence")


@dataclass
class TextSection:
    paths: list[str] = setting([], "text files and folders, as a list: [a.txt, docs/]; empty: the Python stdlib "
                                   "sources (bytes)")
    dataset: Optional[str] = setting(None, "a local HF dataset folder or json/jsonl/parquet file (needs tokenizer)")
    text_field: str = setting("text", "dataset column holding the text")
    tokenizer: Optional[str] = setting(None, "local tokenizer folder; null: UTF-8 bytes (vocab 256)")
    max_files: Optional[int] = setting(None, "cap on stdlib / folder files read")
    val_fraction: float = setting(VAL_FRACTION, "share held out for validation: of the documents, or of each "
                                                "document's last tokens when documents are too few (0: none)")
    errors: str = setting("replace", "invalid UTF-8 in text files: replace (with U+FFFD, counted in the log) or "
                                     "strict")
    prepared: Optional[str] = setting(None, "a folder written by `linmem data prepare` (replaces paths, dataset, "
                                            "tokenizer, max_files and val_fraction)")


@dataclass
class InstructSection:
    path: Optional[str] = setting(None, "a local JSON (list) or JSONL file of Alpaca records: instruction, input, "
                                        "output")
    tokenizer: Optional[str] = setting(None, "local tokenizer folder (a linearized model's folder holds its "
                                             "source's)")
    max_tokens: int = setting(1024, "an example is cut to this many tokens (prompt first; cut answers lose their "
                                    "end)")
    val_fraction: float = setting(0.02, "examples held out for the answer-token loss")


@dataclass
class DataSection:
    task: str = setting("mqar", "mqar, text or instruct (prompt-masked instruction data, packed)")
    batch_size: int = setting(64, "examples per micro-batch (mqar)")
    tokens_per_batch: int = setting(4096, "tokens per packed micro-batch (text, instruct)")
    max_document_tokens: Optional[int] = setting(1024, "longer documents are cut into pieces of this many tokens "
                                                       "(text)")
    seed: int = setting(0, "data order, held-out documents and synthetic examples")
    mqar: MQARSection = section(MQARSection, "multi-query associative recall (data.task=mqar)")
    text: TextSection = section(TextSection, "local text, a local dataset or prepared shards (data.task=text)")
    instruct: InstructSection = section(InstructSection, "instruction data (data.task=instruct)")
