"""CUDA-graph micro-steps, what a CPU can check: the padding of packed batches changes nothing, and what cannot be
captured is refused by name (the captures themselves: tests/train/test_step_modes_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.train import ConfigError, Trainer, load_config
from linmem.train import trainer as trainer_module
from linmem.train.graphs import GraphCaptureError, capacity, graph_refusal, pad_cu_seqlens
from linmem.train.metrics import read_metrics


def test_capacity_is_the_next_power_of_two():
    assert [capacity(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


def test_padding_appends_empty_sequences_and_refuses_too_many():
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    padded = pad_cu_seqlens(cu, 5)
    assert padded.tolist() == [0, 4, 4, 9, 9, 9] and padded.dtype == torch.int32
    with pytest.raises(ValueError, match="3 sequences do not fit in 2"):
        pad_cu_seqlens(cu, 2)


@pytest.mark.parametrize("pattern,memory,attention", [("LN", "gated_deltanet", "softmax"), ("LL", "mamba2", "softmax"),
                                                      ("N", "gated_deltanet", "fox")])
def test_empty_sequences_at_the_end_change_no_loss_and_no_gradient(pattern, memory, attention):
    """What a packed graph relies on: the padded batch trains as the batch itself."""
    torch.manual_seed(0)
    model = LinmemForCausalLM(LinmemConfig(vocab_size=64, hidden_size=32, num_heads=2, intermediate_size=64,
                                           layer_pattern=pattern, memory=memory, attention=attention))
    ids = torch.randint(0, 64, (1, 40))
    cu = torch.tensor([0, 9, 9, 31, 40], dtype=torch.int32)
    results = []
    for cu_seqlens in (cu, pad_cu_seqlens(cu, capacity(4) * 2)):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, cu_seqlens=cu_seqlens, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss, grads), (padded_loss, padded_grads) = results
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-6)
    for got, expected in zip(padded_grads, grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_what_cannot_be_captured_is_refused_by_name(tmp_path):
    moe = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="L", mlp="moe",
                                         moe=dict(num_experts=2, intermediate_size=16)))
    assert "model.layers.0.mlp routes tokens" in graph_refusal(moe, torch.device("cuda"), world=1)
    assert "one process" in graph_refusal(moe, torch.device("cuda"), world=2)
    titans = LinmemForCausalLM(LinmemConfig(vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="L",
                                            memory="titans", titans={"momentum": True}))
    assert "model.layers.0.mixer is Titans' memory with momentum" in graph_refusal(titans, torch.device("cuda"), 1)
    config = load_config(overrides=["data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "model.hidden_size=16",
                                    "model.layer_pattern=N", "run.device=cpu", "run.cuda_graph=true",
                                    f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="run.cuda_graph=true: CUDA graphs need a CUDA device, not cpu"):
        Trainer(config)


class _Uncapturable:
    """Stands for a model whose step reads a GPU value on the host: its capture fails."""

    def __init__(self, model, autocast_dtype):
        pass

    def __call__(self, batch, weight):
        raise GraphCaptureError("the training step could not be captured as a CUDA graph (a host read)")


def test_a_failed_capture_under_the_default_trains_on_eagerly_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(trainer_module, "graph_refusal", lambda model, device, world: None)
    monkeypatch.setattr(trainer_module, "GraphedMicroSteps", _Uncapturable)
    overrides = ["data.mqar.vocab_size=32", "data.mqar.settings=[[16, 2]]", "data.mqar.train_examples=32",
                 "data.mqar.eval_examples=8", "data.batch_size=8", "model.hidden_size=16", "model.layer_pattern=N",
                 "schedule.steps=2", "run.log_every=1", "run.progress=false", "run.tensorboard=false"]
    result = Trainer(load_config(overrides=[*overrides, f"run.out_dir={tmp_path / 'default'}"])).train()
    assert result.steps == 2 and "the run goes on with eager steps" in caplog.text
    modes = [row for row in read_metrics(tmp_path / "default" / "metrics.jsonl") if "mode" in row]
    assert modes == [{"step": 0, "mode": "graph"}, {"step": 1, "mode": "eager"}]
    asked = Trainer(load_config(overrides=[*overrides, "run.cuda_graph=true", f"run.out_dir={tmp_path / 'asked'}"]))
    with pytest.raises(GraphCaptureError, match="a host read"):
        asked.train()
