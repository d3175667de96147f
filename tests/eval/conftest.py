"""Shared fixtures of the text evaluations: a tiny byte-level model and a tiny trained text run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from linmem.models import LinmemConfig, LinmemForCausalLM

@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny models run on one intra-op thread: on a shared CPU, two threads waiting on each other
    make these tests tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def tiny_byte_model(pattern: str = "LN", seed: int = 0) -> LinmemForCausalLM:
    """A byte-level model of about 10k parameters (width 16, two heads)."""
    torch.manual_seed(seed)
    config = LinmemConfig(vocab_size=256, hidden_size=16, num_heads=2, layer_pattern=pattern, intermediate_size=32)
    return LinmemForCausalLM(config).eval()


def write_corpus(folder: Path, documents: int = 12, words: int = 160) -> Path:
    """Plain-text documents of a few hundred bytes each."""
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        text = " ".join(WORDS[(d * 7 + 3 * i + i // 5) % len(WORDS)] for i in range(words))
        (folder / f"doc{d:02d}.txt").write_text(text + "\n")
    return folder


@pytest.fixture(scope="session")
def text_run(tmp_path_factory) -> Path:
    """A byte-level text run trained for 3 steps: config.yaml, model/, metrics.jsonl."""
    from linmem.train import Trainer, load_config

    root = tmp_path_factory.mktemp("text_run")
    corpus = write_corpus(root / "corpus")
    config = load_config(overrides=[
        "data.task=text", f"data.text.paths=[{corpus}]", "data.text.val_fraction=0.25", "data.tokens_per_batch=256",
        "data.max_document_tokens=64", "model.hidden_size=16", "model.num_heads=2", "model.layer_pattern=LN",
        "model.options.intermediate_size=32", "schedule.steps=3", "schedule.warmup_steps=1", "run.save_every=0",
        "run.progress=false", "run.tensorboard=false", "run.device=cpu", f"run.out_dir={root / 'run'}",
    ])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(config).train()
    finally:
        torch.set_num_threads(threads)
    return root / "run"


class NeedleOracle(nn.Module):
    """A stand-in model that answers needle prompts by reading them (bytes in, bytes out).

    It finds the queried keys on the prompt's last line and answers with their values from the
    needles, then a newline, emitting one byte per step through the decoding-cache protocol of
    ``greedy_generate``. With ``reach`` < 1 it only sees needles in the first ``reach`` of the
    haystack's lines, so its accuracy falls with depth.
    """

    def __init__(self, reach: float = 1.0) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(num_hidden_layers=1)
        self.reach = reach

    def _answer(self, prompt: str) -> str:
        lines = prompt.split("\n")
        body, question = lines[1:-1], lines[-1]
        keys = re.search(r".* for (.+?) (?:is|are):$", question).group(1).replace(", and ", ", ").split(", ")
        seen = body[: int(len(body) * self.reach) + 1]
        values = [m.group(2) for line in seen for m in [re.match(r"One of .* for (\S+) is: (\S+)\.$", line)]
                  if m and m.group(1) in keys]
        return " " + ", ".join(values) + "\n"

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=0):
        cache = past_key_values
        if cache.get_seq_length() == 0:
            rows = [bytes(ids[mask.bool()].tolist()).decode() for ids, mask in zip(input_ids, attention_mask)]
            cache.answers = [self._answer(row).encode() for row in rows]
            cache.emitted = 0
        else:
            cache.emitted += 1
        cache.seen_tokens += input_ids.shape[1]
        logits = torch.full((len(input_ids), 1, 256), -1e4)
        for row, answer in enumerate(cache.answers):
            logits[row, 0, answer[min(cache.emitted, len(answer) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


# Local lm-eval tasks: 10 multiple-choice sums, 3 texts to score, 3 prompts to continue.
MC = [{"question": f"{a} plus {b} is", "choices": [f" {a + b}", f" {a + b + 1}", f" {a * b + 7}"], "answer": i % 3}
      for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2), (4, 4), (9, 1), (8, 3), (2, 7)])]
TEXTS = [{"text": "the quick brown fox jumps over the lazy dog"}, {"text": "def area(w, h):\n    return w * h"},
         {"text": "one two three four five six"}]
GEN = [{"question": "x = ", "answer": "1"}, {"question": "print(", "answer": "x)"},
       {"question": "a b c ", "answer": "d"}]


def write_local_tasks(folder: Path) -> Path:
    """lm-eval task YAMLs over JSONL files: toy_choice (multiple choice), toy_perplexity
    (rolling loglikelihood) and toy_generation (generate_until)."""
    folder.mkdir(parents=True, exist_ok=True)

    def task(name, rows, body):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")

    task("toy_choice", MC, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                           "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    task("toy_perplexity", TEXTS, "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                                  "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    task("toy_generation", GEN, "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
                                "doc_to_target: '{{answer}}'\n"
                                "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n"
                                "metric_list:\n  - metric: exact_match\n")
    return folder
