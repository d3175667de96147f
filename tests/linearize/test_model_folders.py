"""``linmem eval`` and ``linmem generate`` on every folder a model is saved in: a ``linmem linearize --out``
folder (a Liger model with its source's tokenizer, no config.yaml), a saved LinmemForCausalLM without a
tokenizer (UTF-8 bytes), and an instruction-tuned run; each through ``linmem.cli.main`` as a user runs it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from linmem.cli import main

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
RECORDS = [{"instruction": f"Repeat the word {w}.", "input": "", "output": f"{w} {w}"} for w in WORDS * 3]
NIAH = ["--suite", "niah", "--lengths", "400", "--samples", "1", "--depths", "1", "--niah-tasks", "niah_single_1",
        "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with a BPE tokenizer, its linearized folder, and a text corpus of a few documents."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from linmem.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("model-folders")
    tokenizer = train_tokenizer(root / "tok", vocab_size=300, max_files=2, show_progress=False)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                         eos_token_id=0, pad_token_id=1))
    llama.save_pretrained(root / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, root / "llama" / name)
    assert main(["linearize", "--from", str(root / "llama"), "--out", str(root / "liger"), "--keep-attention", "2"]) == 0
    corpus = root / "corpus"
    corpus.mkdir()
    for d in range(8):
        (corpus / f"doc{d}.txt").write_text(" ".join(WORDS[(d + 3 * i) % len(WORDS)] for i in range(150)) + "\n")
    (root / "data.json").write_text(json.dumps(RECORDS))
    return {"root": root, "liger": root / "liger", "corpus": corpus, "data": root / "data.json"}


def greedy_text(folder: Path, prompt: str, new: int) -> str:
    """The prompt and its greedy continuation, by transformers alone (AutoModel and AutoTokenizer of ``folder``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=1)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:])


def summary(folder: Path) -> dict[tuple[str, str], float]:
    rows = json.loads((folder / "eval" / "summary.json").read_text())["summary"]
    return {(r["suite"], r["metric"]): r["value"] for r in rows}


def test_a_linearize_output_evaluates_and_generates_with_its_tokenizer(folders, capsys, caplog):
    liger, corpus = folders["liger"], folders["corpus"]
    with caplog.at_level(logging.INFO, logger="linmem"):
        status = main(["eval", str(liger), f"data.text.paths=[{corpus}]", "data.text.val_fraction=0.25", "--suite", "perplexity,position-loss",
                       "--lengths", "128", "--bins", "4", "--max-windows", "2", "--concat", "--no-progress"])
    assert status == 0, capsys.readouterr().err
    assert f"text goes through the tokenizer in {liger}" in caplog.text
    assert f"read the held-out documents of {corpus}" in caplog.text
    metrics = summary(liger)
    assert metrics[("perplexity", "val_ppl")] > 1 and metrics[("position-loss", "loss/L128")] > 0
    assert (liger / "eval" / "position_loss.png").is_file()
    assert main(["eval", str(liger), f"data.text.paths=[{corpus}]", *NIAH]) == 0
    assert 0 <= summary(liger)[("niah", "niah_single_1/mean")] <= 1
    capsys.readouterr()
    assert main(["generate", str(liger), "--prompt", "alpha beta", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(liger, "alpha beta", 6) + "\n"


def test_lm_eval_tasks_run_on_a_model_folder(folders):
    pytest.importorskip("lm_eval", reason="the lm-eval bridge needs lm-eval: pip install 'linmem[eval]'")
    from tests.eval.conftest import write_local_tasks

    tasks = write_local_tasks(folders["root"] / "tasks")
    assert main(["eval", str(folders["liger"]), "--harness", "toy_choice", "--include-path", str(tasks),
                 "--local-tasks-only", "--limit", "4", "--no-progress"]) == 0
    harness = json.loads((folders["liger"] / "eval" / "harness.json").read_text())
    assert harness["n-samples"]["toy_choice"]["effective"] == 4
    assert 0 <= harness["results"]["toy_choice"]["acc,none"] <= 1


def test_a_saved_model_without_a_tokenizer_reads_bytes(folders, tmp_path, capsys, caplog):
    from linmem.models import LinmemConfig, LinmemForCausalLM

    torch.manual_seed(1)
    model = LinmemForCausalLM(LinmemConfig(vocab_size=256, hidden_size=16, num_heads=2, layer_pattern="LN",
                                           intermediate_size=32)).eval()
    model.save_pretrained(tmp_path / "bytes")
    with caplog.at_level(logging.INFO, logger="linmem"):
        status = main(["eval", str(tmp_path / "bytes"), f"data.text.paths=[{folders['corpus']}]", "data.text.val_fraction=0.25", "--suite",
                       "position-loss", "--lengths", "64,128", "--bins", "4", "--max-windows", "2", "--no-progress"])
    assert status == 0, capsys.readouterr().err
    assert "UTF-8 bytes (the folder holds no tokenizer" in caplog.text
    assert ("position-loss", "loss_past_train/L128") not in summary(tmp_path / "bytes")  # 1024: the default length
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "bytes"), "--prompt", "ab", "--max-new-tokens", "5", "--temperature",
                 "0"]) == 0
    ids = model.generate(torch.tensor([list(b"ab")]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert capsys.readouterr().out == bytes(ids[0].tolist()).decode("utf-8", errors="replace") + "\n"


def test_an_instruction_tuned_run_evaluates_and_generates(folders, tmp_path, capsys):
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'linmem[liger]')")
    run = tmp_path / "instruct"
    liger = folders["liger"]
    assert main(["train", "--recipe", "liger-lora", f"model.pretrained={liger}", f"data.instruct.path={folders['data']}",
                 f"data.instruct.tokenizer={liger}", "data.instruct.val_fraction=0.2", "data.tokens_per_batch=256",
                 "schedule.steps=2", "schedule.warmup_steps=1", f"run.out_dir={run}", "run.progress=false",
                 "run.tensorboard=false"]) == 0
    assert main(["eval", str(run), "--no-progress"]) == 0  # its own metric: the held-out answers' loss
    trained = json.loads((run / "finished.json").read_text())["metrics"]
    assert summary(run)[("perplexity", "val_loss")] == pytest.approx(trained["val_loss"], rel=1e-5)
    assert main(["eval", str(run), *NIAH]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--suite", "position-loss"]) == 2
    err = capsys.readouterr().err
    assert "trained on instruction examples" in err and f"linmem eval {run / 'model'} --suite position-loss" in err
    assert main(["eval", str(run / "model"), f"data.text.paths=[{folders['corpus']}]", "data.text.val_fraction=0.25", "--suite", "position-loss",
                 "--lengths", "128", "--bins", "4", "--max-windows", "2", "--concat", "--no-progress"]) == 0
    capsys.readouterr()
    prompt = "Repeat the word beta."
    assert main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(run / "model", prompt, 4) + "\n"


def test_a_model_folder_is_a_text_model_on_the_default_corpus(folders, tmp_path):
    from linmem.train.runs import model_folder_config

    config = model_folder_config(folders["liger"])
    assert (config.data.task, config.data.text.paths, config.data.text.tokenizer) == ("text", [], str(folders["liger"]))
    tmp_path.joinpath("config.json").write_text("{}")
    assert model_folder_config(tmp_path, ["data.text.max_files=3"]).data.text.tokenizer is None
