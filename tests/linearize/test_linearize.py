"""linearize on tiny Llama / Mistral / Qwen2 / Qwen3 checkpoints made here with transformers: the converted folder
loads with AutoModelForCausalLM, adds no parameter and holds every pretrained tensor bit for bit; with
the memory branch at weight 0 and a window covering the sequence, Liger Attention is the base model's
attention (and full-attention layers always are); generate with the real window cache equals the full
forward; unsupported checkpoints are refused with a named error before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import linmem  # noqa: F401  (registers the linmem model with the Auto classes)
from linmem.linearize import LinearizeOptions, UnsupportedCheckpointError, linearize
from linmem.linearize.mapping import linmem_name
from linmem.models import LinmemForCausalLM

VOCAB = 96
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}


def hf_model(family: str):
    """A two-layer model of ``family`` with GQA, norms and biases moved off their init."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":  # tied embeddings, Llama 3.1 RoPE scaling, head_dim 8
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                          rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
    elif family == "mistral":  # a sliding window in every layer
        config = transformers.MistralConfig(**common, sliding_window=6)
    elif family == "qwen2":  # q/k/v biases
        config = transformers.Qwen2Config(**common)
    else:  # q/k norms, head_dim 16 != hidden / heads
        config = transformers.Qwen3Config(**common, head_dim=16)
    model_class = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf")
    saved = {}
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        model = hf_model(family)
        model.save_pretrained(root / family)
        saved[family] = (root / family, model)
    return saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_weights_copied_bit_for_bit_and_window_branch_alone_is_the_base_attention(family, checkpoints, tmp_path):
    source, base = checkpoints[family]
    window = 6 if family == "mistral" else 16  # Mistral's own window in every layer; else covering the sequence
    options = LinearizeOptions(memory="gla", window=window, memory_weight=0.0, keep_attention=2)
    result = linearize(source, tmp_path / "liger", options)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "liger").eval()
    assert type(model) is LinmemForCausalLM and model.config.layer_pattern == "LN" == result.layer_pattern
    assert model.num_all_parameters() == sum(p.numel() for p in base.parameters()) == result.parameters
    assert result.new_parameters == []
    ours = model.state_dict()
    for name, tensor in base.state_dict().items():
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            gate_up = ours[re.sub(r"mlp\.(gate|up)_proj", "mlp.gate_up", name)]
            half = tensor.shape[0]
            tensor_in_ours = gate_up[:half] if ".gate_proj." in name else gate_up[half:]
        else:
            tensor_in_ours = ours[linmem_name(name)]
        assert torch.equal(tensor_in_ours, tensor), name
    ids = torch.randint(0, VOCAB, (2, 14))
    with torch.no_grad():
        assert rel(model(ids, use_cache=False).logits, base(ids).logits) < 1e-5


def test_generate_with_the_window_cache_equals_the_full_forward(checkpoints, tmp_path):
    linearize(checkpoints["llama"][0], tmp_path / "liger", LinearizeOptions(memory="gla", window=4, keep_attention=2))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "liger").eval()
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        static = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
        assert torch.equal(static, generated)
        x = ids
        for _ in range(8):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(generated, x)
        out = model(generated, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert cache[0].get("k").shape[1] == 4  # a ring of the window, not the 15 tokens seen


def test_an_ablation_adds_only_its_parameters(checkpoints, tmp_path):
    source, base = checkpoints["qwen3"]
    result = linearize(source, tmp_path / "liger", LinearizeOptions(gate="projection", memory="mamba2"))
    assert result.new_parameters == ["model.layers.0.mixer.gate_proj.weight", "model.layers.1.mixer.gate_proj.weight"]
    assert result.parameters - result.pretrained_parameters == 2 * 2 * 32  # Hkv x 1 gate per head, from D = 32
    record = json.loads((tmp_path / "liger" / "linearize.json").read_text())
    assert record["options"]["memory"] == "mamba2" and record["family"] == "qwen3"


def edit_config(folder: Path, tmp_path: Path, **changes) -> Path:
    """A copy of a checkpoint folder with config.json changed."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "RoPE scaling 'yarn'"),
    (dict(use_sliding_window=True), "sliding windows"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(intermediate_size=40), r"mlp\.\w+\.weight has shape \[\d+, \d+\], the model expects"),
])
def test_unsupported_checkpoints_are_refused_before_writing(changes, message, checkpoints, tmp_path):
    source = edit_config(checkpoints["qwen2"][0], tmp_path, **changes)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedCheckpointError, match=message):
        linearize(source, out)
    assert not out.exists()


def test_bad_options_and_a_used_folder_are_refused(checkpoints, tmp_path):
    source = checkpoints["llama"][0]
    with pytest.raises(ValueError, match="memory_weight"):
        linearize(source, tmp_path / "a", LinearizeOptions(memory_weight=2.0))
    with pytest.raises(UnsupportedCheckpointError, match="num_slots"):  # 5 slots do not divide head_dim 8
        linearize(source, tmp_path / "b", LinearizeOptions(memory="gsa", slots=5))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder"):
        linearize(source, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
