"""The command line as a user meets it: an instant --help, one-line errors with status 2,
streamed generation with top-k / top-p / stop, and Ctrl-C that saves and resumes exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from linmem import __version__
from linmem.cli import main
from linmem.train import RunError, Trainer, load_config
from linmem.data.codec import byte_detokenize
from linmem.train.metrics import read_metrics
from linmem.train.runs import _TextStream

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_help_imports_neither_torch_nor_transformers_and_version_prints(capsys):
    code = ("import sys, time\nstart = time.perf_counter()\nfrom linmem.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules], time.perf_counter() - start, "
            "file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert "usage: linmem" in done.stdout and "data" in done.stdout
    assert done.stderr.startswith("[] "), done.stderr  # nothing heavy imported: --help answers at once
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"linmem {__version__}"


CONFIG_ONLY = [  # mistakes that only the config decides: named before torch loads
    (["schedule.steps=40", "schedule.warmup_steps=60"], "schedule.warmup_steps (60) must be <= schedule.steps (40)"),
    (["data.task=text", "data.text.paths=corpus.txt"], "write a list in brackets, e.g. data.text.paths=[corpus.txt]"),
    (["data.text.prepared=data/p", "data.text.val_fraction=0.1"], "data.text.val_fraction=0.1 does not apply"),
    (["parallel.dp=2"], "launch with torchrun --nproc-per-node 2"),
    (["parallel.sp=2"], "launch with torchrun --nproc-per-node 2"),
    (["optim.lr=-1"], "optim.lr must be > 0"),
    (["run.progres=false"], "did you mean 'progress'?"),
]


@pytest.mark.parametrize("overrides,message", CONFIG_ONLY, ids=[" ".join(c[0]) for c in CONFIG_ONLY])
def test_config_mistakes_are_named_before_torch_loads(overrides, message, tmp_path):
    code = ("import sys\nfrom linmem.cli import main\n"
            f"status = main(['train', *{overrides!r}, 'run.out_dir={tmp_path / 'never'}'])\n"
            "print(status, [m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith("linmem: error: ") and message in done.stderr, done.stderr
    assert not (tmp_path / "never").exists()


def test_a_short_run_warms_up_for_a_tenth_of_its_steps():
    assert load_config(overrides=["schedule.steps=40"]).schedule.warmup == 4
    assert load_config(overrides=["schedule.steps=5000"]).schedule.warmup == 50  # at most 50, the old default
    assert load_config(overrides=["schedule.steps=40", "schedule.warmup_steps=0"]).schedule.warmup == 0


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """A tiny byte-level text run, trained once for the tests of this module."""
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 6)
    run_dir = root / "run"
    assert main(["train", "data.task=text", f"data.text.paths=[{str(corpus)!r}]", "data.text.val_fraction=0.2",
                 "data.tokens_per_batch=256", "data.max_document_tokens=128", "model.hidden_size=16",
                 "model.layer_pattern=LN", "schedule.steps=6", "schedule.warmup_steps=2", "run.progress=false",
                 "run.tensorboard=false", f"run.out_dir={run_dir}"]) == 0
    return run_dir


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("linmem: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_errors_are_one_line_with_status_2(text_run, tmp_path, capsys, monkeypatch):
    cases = [
        (["train", "model.memroy=gla"], "unknown key 'model.memroy' (did you mean 'memory'?)"),
        (["train", "model.options.mixer.windw=16"], "did you mean 'window'?"),
        (["eval", str(tmp_path / "missing")], f"run directory {tmp_path / 'missing'} not found"),
        (["generate", str(text_run), "--temperature", "-1"], "temperature must be >= 0 (0 = greedy), got -1.0"),
        (["generate", str(text_run), "--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (byte b'\\xe9'"),
        (["generate", str(text_run), "--top-p", "1.5"], "top_p must lie in (0, 1]"),
        (["train", "data.task=text", f"data.text.dataset={tmp_path}", "data.text.tokenizer=tok",
          f"run.out_dir={tmp_path / 'run'}"], "needs the optional package `datasets`"),
    ]
    if not torch.cuda.is_available():
        cases.append((["train", "run.device=cuda", f"run.out_dir={tmp_path / 'run'}"], "CUDA is not available"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without the [data] extra
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in _error_line(capsys)
    assert main(["-v", "train", "model.memroy=gla"]) == 2
    assert "Traceback" in capsys.readouterr().err  # -v shows where it came from


def test_eval_and_streamed_generation_with_top_k_top_p_and_stop(text_run, capsys):
    assert main(["eval", str(text_run)]) == 0
    assert "val_ppl" in capsys.readouterr().out
    prompt = ["generate", str(text_run), "--prompt", "the quick", "--max-new-tokens", "16"]
    assert main([*prompt, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("the quick") and greedy.endswith("\n")
    continuation = greedy[len("the quick"):-1]
    candidates = [c for c in continuation if c != "\ufffd"]  # a character the model wrote, letters first
    stop = sorted(candidates, key=lambda c: not (c.isascii() and c.isalnum()))[0]
    assert main([*prompt, "--temperature", "0", "--stop", stop]) == 0
    assert capsys.readouterr().out == "the quick" + continuation[:continuation.index(stop)] + "\n"
    sampled = [*prompt, "--temperature", "1.0", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    assert main(sampled) == 0 and main(sampled) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second and first.startswith("the quick")


def test_the_stream_holds_back_partial_characters_and_stop_prefixes():
    pieces: list[str] = []
    stream = _TextStream(byte_detokenize, pieces.append, stop="END")
    stream.put(torch.tensor([[1, 2, 3]]))  # the prompt, not shown again
    for i, byte in enumerate("héllo EN".encode()):
        stream.put(torch.tensor([byte]))
        if i == 1:
            assert "".join(pieces) == "h"  # the first byte of é waits for the second
    assert "".join(pieces) == "héllo " and not stream.stopped  # "EN" may begin the stop string
    for byte in "D and more".encode():
        stream.put(torch.tensor([byte]))
    stream.end()
    assert stream.stopped and stream.text == "héllo " and "".join(pieces) == "héllo "
    released: list[str] = []
    stream = _TextStream(byte_detokenize, released.append, stop="END")
    stream.put(torch.tensor([[0]]))
    for byte in b"EN!":
        stream.put(torch.tensor([byte]))
    assert "".join(released) == "EN!" and not any("\ufffd" in p for p in pieces + released)


SLOW_TRAIN = """
import sys, time
import torch
torch.set_num_threads(1)
from linmem.train.trainer import Trainer
step = Trainer._optimizer_step
def slow(self, batches):
    time.sleep(0.05)
    return step(self, batches)
Trainer._optimizer_step = slow
from linmem.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _losses(run_dir: Path) -> dict[int, float]:
    """The losses logged so far (a line the run is writing is left out)."""
    return {row["step"]: row["loss"] for row in read_metrics(run_dir / "metrics.jsonl") if "loss" in row}


def test_ctrl_c_saves_a_checkpoint_refuses_a_second_run_and_resumes_exactly(tmp_path, capsys):
    common = ["data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=64",
              "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=LN",
              "schedule.warmup_steps=0", "schedule.min_lr_ratio=1", "run.save_every=0", "run.log_every=1",
              "run.progress=false", "run.tensorboard=false"]  # a constant learning rate: any step count fits
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", SLOW_TRAIN, "train", *common, "schedule.steps=400",
                              f"run.out_dir={run_dir}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len(_losses(run_dir)) < 2:
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.02)
    with pytest.raises(RunError, match=f"in use by another linmem run \\(PID {child.pid}\\)"):
        Trainer(load_config(overrides=[*common, "schedule.steps=400", f"run.out_dir={run_dir}"])).train()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    stopped = re.search(r"interrupted at step (\d+), checkpoint saved; run the same command to resume", err)
    assert stopped and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    steps = int(stopped.group(1)) + 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *common, f"schedule.steps={steps}", f"run.out_dir={run_dir}"]) == 0  # resumed
        Trainer(load_config(overrides=[*common, f"schedule.steps={steps}", f"run.out_dir={tmp_path / 'whole'}"])
                ).train()
    finally:
        torch.set_num_threads(threads)
    assert _losses(run_dir) == _losses(tmp_path / "whole") and len(_losses(run_dir)) == steps
