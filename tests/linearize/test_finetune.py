"""Fine-tuning a linearized model: prompt-masked, packed Alpaca data (JSON and JSONL, resumable, bad
records named), and ``linmem linearize ... --lora-rank --data`` training a few steps with LoRA on q/k/v
only, then saving an adapter and a merged model that loads without peft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from linmem.data.instruct import (
    InstructBatches,
    encode_examples,
    format_prompt,
    predicted_answer_tokens,
    read_records,
)
from linmem.data.sources import DataError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
RECORDS = [{"instruction": f"Repeat the word {w}.", "input": "twice" if i % 2 else "", "output": f"{w} {w}"}
           for i, w in enumerate(WORDS * 3)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from linmem.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, max_files=2, show_progress=False)


def test_records_from_json_and_jsonl_and_bad_records_named(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(RECORDS))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert read_records(tmp_path / "a.json") == read_records(tmp_path / "a.jsonl") == RECORDS
    assert "### Input:\ntwice" in format_prompt(RECORDS[1]) and "### Input" not in format_prompt(RECORDS[0])
    (tmp_path / "bad.jsonl").write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(DataError, match="record 1 must be an object with string 'instruction' and 'output'"):
        read_records(tmp_path / "bad.jsonl")


def test_prompts_are_masked_and_rows_packed_whole_and_resumable(tokenizer_dir):
    from linmem.data.codec import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    examples = encode_examples(RECORDS, tokenizer, max_tokens=1000)
    prompt = tokenizer(format_prompt(RECORDS[0]))["input_ids"]
    answer = tokenizer(RECORDS[0]["output"], add_special_tokens=False)["input_ids"]
    assert examples.tokens[0].tolist() == prompt + answer + [tokenizer.eos_token_id]
    assert examples.labels(0).tolist() == [-100] * len(prompt) + answer + [tokenizer.eos_token_id]
    row = 3 * max(len(t) for t in examples.tokens)
    batches = InstructBatches(examples, row, pad_id=1, seed=0)
    for _ in range(4):
        batch = next(batches)
        cu = batch["cu_seqlens"].tolist()
        assert batch["input_ids"].shape == (1, row) and cu[-1] == row
        in_row = []
        for a, b in zip(cu[:-1], cu[1:]):
            piece = batch["input_ids"][0, a:b].numpy()
            match = [i for i, t in enumerate(examples.tokens) if np.array_equal(t, piece)]
            assert match or (piece == 1).all()  # whole examples, then padding
            in_row += match[:1]
        answers = sum(len(examples.tokens[i]) - examples.prompt_lengths[i] for i in in_row)
        assert predicted_answer_tokens(batch["labels"], batch["cu_seqlens"]) == answers
    state = batches.state_dict()
    following = next(batches)
    resumed = InstructBatches(examples, row, pad_id=1, seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)["input_ids"], following["input_ids"])
    cut = encode_examples(RECORDS, tokenizer, max_tokens=len(prompt) + 1)
    assert len(cut.tokens[0]) == len(prompt) + 1 and cut.labels(0)[-1] == answer[0]


def test_linearize_then_lora_saves_an_adapter_and_a_merged_model(tmp_path, tokenizer_dir):
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'linmem[liger]')")
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from linmem.cli import main

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=1))
    base.save_pretrained(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "llama" / name)
    (tmp_path / "data.json").write_text(json.dumps(RECORDS))
    out = tmp_path / "liger"
    status = main(["linearize", "--from", str(tmp_path / "llama"), "--out", str(out), "--keep-attention", "2",
                   "--lora-rank", "4", "--data", str(tmp_path / "data.json"), "--steps", "2",
                   "--tokens-per-batch", "256", "--lr", "0.01"])
    assert status == 0
    run = out / "finetune"
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj"}
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    converted = AutoModelForCausalLM.from_pretrained(out)
    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    before, after = converted.state_dict(), merged.state_dict()
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj") for name in changed)
    assert "val_loss" in json.loads((run / "finished.json").read_text())["metrics"]
    from linmem.train.runs import load_run

    text = load_run(run).generate("Repeat the word beta.", max_new_tokens=3, temperature=0)  # the run's tokenizer
    assert text.startswith("Repeat the word beta.")


def test_fine_tuning_a_saved_model_under_torchrun_is_refused(monkeypatch):
    from linmem.train.config import ConfigError, TrainConfig
    from linmem.train.trainer import check_launch

    config = TrainConfig()
    config.model.pretrained, config.lora.rank = "checkpoints/liger", 8
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="WORLD_SIZE=2: fine-tuning a saved model"):
        check_launch(config)
