"""Bad and edge inputs at every public boundary, as a hostile or careless user would give them.

Each case of :data:`CASES` declares its outcome: ``named`` (a ValueError, TypeError, FileNotFoundError or a
linmem error class whose message names the offending argument or field) or ``correct`` (the right, finite
answer, compared with a reference). Cases marked ``fixed`` were an unclear crash or a silent wrong/NaN result
before the validation that now serves them. ``python tests/test_bad_inputs.py`` prints the counts.
"""

from __future__ import annotations

import json
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F

from linmem.ops import bayes_filter, bayes_filter_step, linear_recurrence, linear_recurrence_step
from linmem.ops.attention import forgetting_attention
from linmem.ops.fused import gated_rms_norm, l2_norm, linear_cross_entropy, rms_norm, short_conv, short_conv_step, swiglu
from tests.helpers import rel_err

NAMED_ERRORS = (ValueError, TypeError, FileNotFoundError)


@dataclass(frozen=True)
class Case:
    name: str  # what is tried
    call: Callable[[SimpleNamespace], Any]  # runs the input against the shared tiny objects
    error: Optional[tuple[type, ...]] = None  # named: the accepted error classes (None: a correct answer)
    says: str = ""  # named: a substring of the message that names the argument or field
    fixed: bool = False  # an unclear crash or a silent wrong result before its validation existed

    @property
    def outcome(self) -> str:
        return "correct" if self.error is None else "named"


def named(name: str, call: Callable, says: str, error: tuple[type, ...] = NAMED_ERRORS, fixed: bool = False) -> Case:
    return Case(name, call, error, says, fixed)


def correct(name: str, call: Callable, fixed: bool = False) -> Case:
    """``call`` returns True after its own checks, or pairs (got, reference) of tensors to compare."""
    return Case(name, call, None, "", fixed)


# ---------------------------------------------------------------- the shared small inputs

B, T, H, K, V = 1, 6, 2, 4, 4
_gen = torch.Generator().manual_seed(0)


def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen, dtype=torch.float64).to(dtype)


def qkv(b: int = B, t: int = T, dtype: torch.dtype = torch.float32) -> dict:
    return {"q": rnd(b, t, H, K, dtype=dtype), "k": F.normalize(rnd(b, t, H, K), dim=-1).to(dtype),
            "v": rnd(b, t, H, V, dtype=dtype)}


def gates(b: int = B, t: int = T) -> torch.Tensor:
    return F.logsigmoid(rnd(b, t, H) + 2)


def lr(**over: Any):
    x = {**qkv(), **over}
    return linear_recurrence(**x)


def lr_pair(backend: str = "chunk", **over: Any) -> list:
    """The recurrence by ``backend`` and by the reference (output and final state)."""
    x = {**qkv(), "initial_state": rnd(B, H, K, V), **over}
    o, s = linear_recurrence(**x, output_final_state=True, backend=backend)
    ro, rs = linear_recurrence(**x, output_final_state=True, backend="reference")
    return [(o, ro), (s, rs)]


def step(**over: Any):
    x = {"q": rnd(B, H, K), "k": F.normalize(rnd(B, H, K), dim=-1), "v": rnd(B, H, V), "state": torch.zeros(B, H, K, V)}
    x.update(over)
    return linear_recurrence_step(x.pop("q"), x.pop("k"), x.pop("v"), x.pop("state"), **x)


def fa(**over: Any):
    x = {**qkv(), **over}
    return forgetting_attention(x.pop("q"), x.pop("k"), x.pop("v"), **x)


def bf(**over: Any):
    x = {**qkv(), "log_decay": gates(), "obs_noise": torch.full((B, T, H), 0.5), **over}
    return bayes_filter(x.pop("q"), x.pop("k"), x.pop("v"), **x)


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def cu(*bounds: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(bounds, dtype=dtype)


def with_token(t: torch.Tensor, index: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[:, index] = value
    return t


def recurrence_with_neg_inf_gate(kind: str) -> list:
    shape = {"scalar": (B, T, H), "vector": (B, T, H, K), "constant": (H,)}[kind]
    g = F.logsigmoid(rnd(*shape) + 2)
    if kind == "constant":
        g[0] = float("-inf")
    else:
        g[:, 2] = float("-inf")
    return lr_pair(log_decay=g)


def recurrence_empty_time() -> bool:
    s0 = rnd(B, H, K, V)
    for backend in ("reference", "chunk"):
        o, s = linear_recurrence(**qkv(t=0), initial_state=s0, output_final_state=True, backend=backend)
        assert o.shape == (B, 0, H, V) and torch.equal(s, s0), backend
    return True


def recurrence_empty_sequence() -> list:
    """cu_seqlens holding an empty sequence: its final state is its initial state; the others as if alone."""
    x, s0, g = qkv(), rnd(3, H, K, V), gates()
    o, s = linear_recurrence(**x, log_decay=g, initial_state=s0, output_final_state=True, cu_seqlens=cu(0, 2, 2, 6))
    pieces = []
    for i, (a, b) in enumerate(((0, 2), (2, 6))):
        part = {n: t[:, a:b] for n, t in x.items()}
        po, ps = linear_recurrence(**part, log_decay=g[:, a:b], initial_state=s0[[0, 2][i]][None],
                                   output_final_state=True, backend="reference")
        pieces.append((o[:, a:b], po))
        pieces.append((s[[0, 2][i]], ps[0]))
    pieces.append((s[1], s0[1]))
    return pieces


def recurrence_nan_token_later_chunk() -> bool:
    """A NaN in token 70 (the second 64-token chunk) leaves the first chunk's outputs finite (documented)."""
    x = qkv(t=72)
    x["k"] = with_token(x["k"], 70, float("nan"))
    for backend in ("reference", "chunk"):
        o, _ = linear_recurrence(**x, log_decay=gates(t=72), backend=backend)
        assert o[:, :64].isfinite().all(), backend
    return True


def step_neg_inf_gate() -> list:
    q, k, v, s0 = rnd(B, H, K), F.normalize(rnd(B, H, K), dim=-1), rnd(B, H, V), rnd(B, H, K, V)
    g = torch.full((B, H), float("-inf"))
    o, s = linear_recurrence_step(q, k, v, s0.clone(), log_decay=g)
    want_s = k[..., :, None] * v[..., None, :]  # the state is erased, then k^T v written
    return [(s, want_s), (o, K ** -0.5 * torch.einsum("bhk,bhkv->bhv", q, want_s))]


def attention_neg_inf_gate() -> list:
    """A forget gate of 0 (log -inf) at token 3 cuts the sequence there: the same as two packed sequences."""
    x, g = qkv(), F.logsigmoid(rnd(B, T, H) + 2)
    o = forgetting_attention(**x, log_forget=with_token(g, 3, float("-inf")), backend="reference")
    split = forgetting_attention(**x, log_forget=with_token(g, 3, 0.0), cu_seqlens=cu(0, 3, 6), backend="reference")
    o_sdpa = forgetting_attention(**x, log_forget=with_token(g, 3, float("-inf")))
    return [(o, split), (o_sdpa, split)]


def attention_huge_window() -> list:
    x = qkv()
    return [(forgetting_attention(**x, window=10 ** 9), forgetting_attention(**x))]


def attention_empty() -> bool:
    o = forgetting_attention(**qkv(t=0), log_forget=gates(t=0))
    assert o.shape == (B, 0, H, V)
    return True


def bayes_neg_inf_decay() -> list:
    """log_decay = -inf (a = 0) is the same filter as a = exp(-200), which is 0 in fp32."""
    x, g = qkv(), gates()
    o, _, _ = bf(**x, log_decay=with_token(g, 2, float("-inf")), backend="reference")
    want, _, _ = bf(**x, log_decay=with_token(g, 2, -200.0), backend="reference")
    return [(o, want)]


def bayes_infinite_obs_noise() -> list:
    """r = inf: every observation is ignored, so the memory stays at its prior mean 0."""
    o, _, _ = bf(obs_noise=torch.full((B, T, H), INF), backend="reference")
    return [(o, torch.zeros(B, T, H, V))]


def bf_step(state: tuple, **over: Any):
    x = {"q": rnd(B, H, K), "k": F.normalize(rnd(B, H, K), dim=-1), "v": rnd(B, H, V), "log_decay": torch.full((B, H), -0.1),
         "obs_noise": torch.ones(B, H), **over}
    return bayes_filter_step(x.pop("q"), x.pop("k"), x.pop("v"), state, **x)


def bayes_state(P: Optional[torch.Tensor] = None) -> tuple:
    return torch.zeros(B, H, K, V), torch.eye(K).repeat(B, H, 1, 1) if P is None else P


def not_a_covariance() -> torch.Tensor:
    P = torch.eye(K).repeat(B, H, 1, 1)
    P[0, 1, 0, 0] = -0.5
    return P


def inference_state() -> tuple:
    with torch.inference_mode():
        return bayes_state()


def bayes_singular_covariance() -> list:
    """P0 of rank K - 1 (a direction known exactly): every backend serves it and agrees with the reference."""
    u = F.normalize(rnd(K), dim=0)
    P0 = (torch.eye(K) - u[:, None] * u[None, :]).repeat(B, H, 1, 1)
    x = {**qkv(), "log_decay": gates(), "obs_noise": torch.full((B, T, H), 0.5), "initial_state": (rnd(B, H, K, V), P0),
         "output_final_state": True}
    pairs = []
    for backend in ("chunk", "triton"):
        o, _, (M, P) = bayes_filter(**x, backend=backend)
        ro, _, (rM, rP) = bayes_filter(**x, backend="reference")
        pairs += [(o, ro), (M, rM), (P, rP)]
    return pairs


def bayes_reset_tiny_obs_noise() -> list:
    """reset=True is the gated delta rule (beta |k|^2 <= 1): obs_noise 1e-30 stays exact in fp32."""
    x = {**qkv(), "log_decay": gates(), "obs_noise": torch.full((B, T, H), 1e-30)}
    o, _, _ = bayes_filter(**x, reset=True)
    want, _, _ = bayes_filter(**{n: t.double() for n, t in x.items()}, reset=True, backend="reference")
    return [(o, want.float())]


def bayes_float64_small_obs_noise() -> list:
    """obs_noise 1e-8 is refused in fp32 and served in fp64 (reference and chunk agree)."""
    x = {n: t.double() for n, t in {**qkv(), "log_decay": gates(), "obs_noise": torch.full((B, T, H), 1e-8)}.items()}
    o, _, _ = bayes_filter(**x, backend="chunk")
    want, _, _ = bayes_filter(**x, backend="reference")
    return [(o, want)]


NAN, INF = float("nan"), float("inf")


def short_conv_empty() -> bool:
    y, state = short_conv(rnd(1, 0, 8), rnd(8, 4), output_final_state=True)
    assert y.shape == (1, 0, 8) and torch.equal(state, torch.zeros(1, 3, 8))
    return True


def l2_norm_zero() -> list:
    return [(l2_norm(torch.zeros(2, 8)), torch.zeros(2, 8))]


def lce_all_ignored() -> list:
    loss = linear_cross_entropy(rnd(4, 8), rnd(16, 8), torch.full((4,), -100), reduction="sum")
    return [(loss, torch.zeros(()))]


# ---------------------------------------------------------------- model, folders, runs

def config(**over: Any):
    from linmem.models import LinmemConfig

    return LinmemConfig(**{"vocab_size": 64, "hidden_size": 16, "num_heads": 2, "layer_pattern": "LN", **over})


def ids(env, *shape: int, high: Optional[int] = None) -> torch.Tensor:
    return torch.randint(0, high or env.model.config.vocab_size, shape, generator=torch.Generator().manual_seed(1))


def model_of(model_config):
    from linmem.models import LinmemForCausalLM

    return LinmemForCausalLM(model_config).eval()


def forward(env, **kwargs: Any):
    with torch.no_grad():
        return env.model(**kwargs)


def packed_equals_separate(env) -> list:
    a, b = ids(env, 1, 3), ids(env, 1, 5)
    with torch.no_grad():
        packed = env.model(torch.cat([a, b], 1), cu_seqlens=cu(0, 3, 8), use_cache=False).logits
        alone = [env.model(x, use_cache=False).logits for x in (a, b)]
    return [(packed, torch.cat(alone, 1))]


def float_mask_equals_none(env) -> list:
    x = ids(env, 2, 5)
    with torch.no_grad():
        return [(env.model(x, attention_mask=torch.ones(2, 5)).logits, env.model(x).logits)]


def shift_labels_win(env) -> list:
    """shift_labels given with labels are the loss's targets, as in transformers' ForCausalLMLoss."""
    from linmem.models.modeling import causal_lm_loss

    x, targets = ids(env, 2, 5), ids(env, 2, 5).masked_fill(torch.eye(2, 5, dtype=torch.bool), -100)
    with torch.no_grad():
        got = env.model(x, labels=ids(env, 2, 5, high=3), shift_labels=targets).loss
        return [(got, causal_lm_loss(env.model(x).logits, None, shift_labels=targets))]


def generate_from_embeddings(env) -> list:
    """generate(inputs_embeds=...) alone gives the tokens that generate(input_ids) appends."""
    x = ids(env, 2, 4)
    embedded = hf_generate(env, None, inputs_embeds=env.model.get_input_embeddings()(x).detach(),
                           attention_mask=torch.ones_like(x), max_new_tokens=3)
    return [(embedded, hf_generate(env, x, max_new_tokens=3)[:, 4:])]


def finite_parameters(model) -> None:
    bad = [n for n, p in model.named_parameters() if not p.isfinite().all() or p.abs().max() > 100]
    assert not bad, f"uninitialised parameters: {bad}"


def load_base_model_as_causal_lm(env) -> bool:
    """A LinmemModel folder (no lm_head): the missing head is initialised as the constructor does."""
    from linmem.models import LinmemForCausalLM

    model = LinmemForCausalLM.from_pretrained(env.base_folder)
    finite_parameters(model)
    std = float(model.lm_head.weight.std())
    assert 0.5 * model.config.initializer_range < std < 2 * model.config.initializer_range, std
    torch.testing.assert_close(model.model.embed_tokens.weight, env.model.model.embed_tokens.weight)
    return True


def load_with_extra_layer(env) -> bool:
    from linmem.models import LinmemForCausalLM

    model = LinmemForCausalLM.from_pretrained(env.folder, layer_pattern="LNL")
    finite_parameters(model)
    fresh = LinmemForCausalLM(config(layer_pattern="LNL"))
    for (name, p), (_, q) in zip(model.model.layers[2].named_parameters(), fresh.model.layers[2].named_parameters()):
        if "norm" in name:  # norms start at their constructor's value (ones), not at garbage
            torch.testing.assert_close(p, q)
    return True


def load_tied_as_untied(env) -> bool:
    from linmem.models import LinmemForCausalLM

    model = LinmemForCausalLM.from_pretrained(env.tied_folder, tie_word_embeddings=False)
    finite_parameters(model)
    return True


def write_folder(env, name: str, files: dict[str, Any]) -> Path:
    folder = env.root / name
    folder.mkdir()
    for file, content in files.items():
        (folder / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def write_yaml(env, text: str) -> str:
    path = env.root / "bad.yaml"
    path.write_text(text)
    return str(path)


def config_json(**over: Any) -> str:
    return json.dumps({**config().to_dict(), **over})


def from_pretrained(folder) -> Any:
    from linmem.models import LinmemForCausalLM

    return LinmemForCausalLM.from_pretrained(folder)


def broken_weights(env, data: bytes) -> Path:
    return write_folder(env, f"weights-{len(data)}", {"config.json": config_json(), "model.safetensors": data})


def truncated_weights(env) -> Path:
    data = (env.folder / "model.safetensors").read_bytes()
    return write_folder(env, "truncated", {"config.json": config_json(), "model.safetensors": data[: len(data) // 2]})


class Payload:
    """Unpickling this would run code: a weights_only load must refuse it."""

    def __reduce__(self):
        return (print, ("unpickled!",))


def pickle_weights_folder(env) -> Path:
    return write_folder(env, "pickle", {"config.json": config_json(), "pytorch_model.bin": pickle.dumps(Payload())})


# ---------------------------------------------------------------- checkpoints

def checkpoint(env, name: str) -> Path:
    """A fresh copy of the module's valid checkpoint."""
    import shutil

    path = env.root / "ckpts" / name / env.checkpoint.name
    shutil.copytree(env.checkpoint, path)
    return path


def verify(path: Path) -> None:
    from linmem.train.checkpoint import verify_checkpoint

    verify_checkpoint(path)


def rewrite(path: Path, file: str, data: bytes, manifest: bool = False) -> Path:
    from linmem.train.checkpoint import _sha256

    (path / file).write_bytes(data)
    if manifest:  # an attacker who also rewrites the manifest
        entries = json.loads((path / "manifest.json").read_text())
        entries[file] = {"bytes": len(data), "sha256": _sha256(path / file)}
        (path / "manifest.json").write_text(json.dumps(entries))
    return path


def load_ckpt(env, path: Path, model=None) -> Any:
    from linmem.train.checkpoint import load_checkpoint

    return load_checkpoint(path, model=model or env.model_copy())


def without(path: Path, file: str) -> Path:
    (path / file).unlink()
    return path


def ckpt_truncated(env) -> Path:
    path = checkpoint(env, "truncated")
    data = (path / "model.safetensors").read_bytes()
    return rewrite(path, "model.safetensors", data[:100])


def ckpt_flipped(env) -> Path:
    path = checkpoint(env, "flipped")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    return rewrite(path, "model.safetensors", bytes(data))


def ckpt_all_invalid(env) -> Any:
    from linmem.train.checkpoint import latest_valid_checkpoint

    path = checkpoint(env, "all-invalid")
    (path / "manifest.json").unlink()
    return latest_valid_checkpoint(path.parent)


def ckpt_missing_dir(env) -> bool:
    from linmem.train.checkpoint import latest_valid_checkpoint

    assert latest_valid_checkpoint(env.root / "no-such-dir") is None
    return True


def ckpt_round_trip(env) -> list:
    model = env.model_copy()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_ckpt(env, env.checkpoint, model)
    return [(p, q) for p, q in zip(model.parameters(), env.model.parameters())]


# ---------------------------------------------------------------- the command line, data, tokenizer

def cli(*argv: str) -> int:
    from linmem.cli import main

    try:
        return main(list(argv))
    except SystemExit as exit_:  # argparse's refusals
        return exit_.code


def llama_folder(env) -> Path:
    """A tiny Llama saved by transformers (another model type than linmem's), written on first use."""
    folder = env.root / "llama"
    if not folder.exists():
        from transformers import LlamaConfig, LlamaForCausalLM

        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    return folder


def train_cli(env, *overrides: str) -> tuple:
    return cli("train", *overrides, f"run.out_dir={env.root / 'cli-run'}", "run.progress=false",
               "run.tensorboard=false")


def gen_cli(env, *args: str) -> tuple:
    return cli("generate", str(env.run_dir), *args)


def text_train(env, folder: Path) -> tuple:
    return train_cli(env, "data.task=text", f"data.text.paths=[{str(folder)!r}]", "schedule.steps=1",
                     "schedule.warmup_steps=0", "data.tokens_per_batch=64", "model.hidden_size=16")


def empty_corpus(env) -> tuple:
    folder = env.root / "empty-corpus"
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_text("")
    (folder / "b.txt").write_text("")
    return text_train(env, folder)


def corpus_with_empty_document(env) -> bool:
    from linmem.data.config import TextSection
    from linmem.data.corpus import load_corpus

    folder = env.root / "one-empty"
    folder.mkdir(exist_ok=True)
    (folder / "__init__.py").write_text("")
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 20)
    corpus = load_corpus(TextSection(paths=[str(folder)], val_fraction=0.25), seed=0)
    lengths = [*corpus.train.lengths.tolist(), *corpus.validation.lengths.tolist()]
    assert len(lengths) == 4 and min(lengths) > 0, lengths  # the four documents, the empty file skipped
    assert sum(c.empty for c in corpus.counts.values()) == 1, corpus.counts
    return True


def non_utf8_files(env, errors: str) -> Any:
    from linmem.data.sources import text_files

    path = env.root / f"latin1-{errors}.txt"
    path.write_bytes("café".encode("latin-1"))
    return text_files([path], errors=errors)


def replaced_non_utf8(env) -> bool:
    assert non_utf8_files(env, "replace") == ["caf\ufffd"]
    return True


def packed_batches(docs: list, tokens: int = 8) -> Any:
    from linmem.data.batches import PackedBatches

    return PackedBatches(docs, tokens_per_batch=tokens, seed=0)


def tokenizer_folder(env, name: str, files: dict[str, str]) -> Any:
    from linmem.data.codec import load_codec

    return load_codec(write_folder(env, name, files))


def train_tok(env, vocab: int = 300, min_frequency: int = 2, paths: Optional[list] = None) -> Any:
    from linmem.tokenizer import train_tokenizer

    return train_tokenizer(env.root / f"tok-{vocab}-{min_frequency}", vocab, paths, min_frequency=min_frequency,
                           max_files=1, show_progress=False)


def byte_codec():
    from linmem.data.codec import byte_codec as codec

    return codec()


def codec_round_trip() -> bool:
    codec = byte_codec()
    assert codec.encode("") == [] and codec.decode(codec.encode("héllo")) == "héllo"
    assert codec.decode([0xC3]) == "\ufffd"  # a cut character decodes, it does not raise
    return True


def generate(env, prompt: str = "ab", **kwargs: Any) -> str:
    return env.run.generate(prompt, max_new_tokens=kwargs.pop("max_new_tokens", 3), **kwargs)


def generate_empty_prompt(env) -> bool:
    text = generate(env, "", temperature=0.0)
    assert isinstance(text, str) and len(text.encode("utf-8", "replace")) >= 1
    return True


def hf_generate(env, input_ids, **kwargs):
    with torch.no_grad():
        return env.model.generate(input_ids, do_sample=False, pad_token_id=0, **kwargs)


def cli_generate_empty_prompt(env) -> bool:
    assert gen_cli(env, "--prompt", "", "--max-new-tokens", "2", "--temperature", "0") == 0
    return True


# ---------------------------------------------------------------- the probe round: shards, model folders, run configs

def prepared_folder(env, name: str) -> Path:
    """A prepared folder of four documents (one held out) written for one case."""
    from linmem.data.config import TextSection
    from linmem.data.prepared import prepare_corpus

    corpus = env.root / "probe-corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(4):
            (corpus / f"doc{i}.txt").write_text(f"document {i} says hello " * 8)
    prepare_corpus(TextSection(paths=[str(corpus)], val_fraction=0.25), env.root / name)
    return env.root / name


def train_on_changed_shard(env, name: str, data: Callable[[int], bytes]) -> int:
    """Training on a prepared folder whose first train shard was rewritten in place with ``data(size)``."""
    folder = prepared_folder(env, name)
    shard = folder / "tokens_train_00000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.write(data(size))
    assert shard.stat().st_size == size
    return cli("train", "data.task=text", f"data.text.prepared={folder}", "data.tokens_per_batch=32",
               "model.hidden_size=16", "schedule.steps=1", "schedule.warmup_steps=0", "run.progress=false",
               "run.tensorboard=false", f"run.out_dir={env.root / (name + '-run')}")


def run_copy(env, name: str, edit: Callable[[Path], Any]) -> Path:
    """A copy of the shared run directory, changed by ``edit``."""
    import shutil

    copy = env.root / name
    shutil.copytree(env.run_dir, copy)
    edit(copy)
    return copy


def resume_with_config(env, name: str, text: str) -> int:
    """Continuing a run (a checkpoint in place) whose config.yaml was replaced by ``text``."""
    import shutil

    run = run_copy(env, name, lambda d: (d / "config.yaml").write_text(text))
    shutil.copytree(env.checkpoint, run / "checkpoints" / env.checkpoint.name)
    return cli("train", "--config", str(env.run_dir / "config.yaml"), f"run.out_dir={run}", "run.progress=false")


def write_file(env, name: str, data: bytes) -> str:
    path = env.root / name
    path.write_bytes(data)
    return str(path)


# ---------------------------------------------------------------- own text and the CLI

def own_text_run(env, name: str, files: dict[str, str]) -> bool:
    """Train one step on ``files`` through the command line; the run ends with a validation loss."""
    folder = write_folder(env, name, files)
    out = env.root / f"{name}-run"
    assert cli("train", "data.task=text", f"data.text.paths=[{str(folder)!r}]", "schedule.steps=1",
               "data.tokens_per_batch=64", "model.hidden_size=16", f"run.out_dir={out}", "run.progress=false",
               "run.tensorboard=false") == 0
    metrics = json.loads((out / "finished.json").read_text())["metrics"]
    assert metrics["val_loss"] > 0, metrics
    return True


def no_validation_run(env) -> Path:
    """A copy of the module's text run whose config holds nothing out (data.text.val_fraction=0)."""
    import shutil

    run = env.root / "no-validation-run"
    if not run.exists():
        shutil.copytree(env.run_dir, run)
        config = run / "config.yaml"
        config.write_text(config.read_text().replace("val_fraction: 0.02", "val_fraction: 0.0"))
    return run


def eval_cli(env, *args: str, run: Optional[Path] = None) -> int:
    return cli("eval", str(run or env.run_dir), "--no-progress", *args)


def bench_ops_without_cuda() -> int:
    from unittest import mock

    with mock.patch("torch.cuda.is_available", return_value=False):
        return cli("bench", "ops")


def tokenizer_into_full_folder(env) -> int:
    folder = write_folder(env, "full-folder", {"keep.txt": "mine"})
    return cli("tokenizer", "train", "--out", str(folder), "--vocab-size", "260", "--max-files", "1")


# ---------------------------------------------------------------- the catalogue


CASES: list[Case] = [
    # linear_recurrence: shapes, dtypes, devices
    named("lr q 3-D", lambda e: lr(q=rnd(T, H, K)), "`q` must be 4-D"),
    named("lr k of another shape", lambda e: lr(k=rnd(B, T, H, K + 1)), "`k` must have shape"),
    named("lr v of another length", lambda e: lr(v=rnd(B, T + 1, H, V)), "`v` must have shape"),
    named("lr q integer", lambda e: lr(q=torch.ones(B, T, H, K, dtype=torch.long)), "`q` must be a floating-point"),
    named("lr q a list", lambda e: lr(q=[[0.0]]), "`q` must be a torch.Tensor"),
    named("lr q fp32, k fp64", lambda e: lr(k=rnd(B, T, H, K, dtype=torch.float64)), "must share one dtype"),
    named("lr k on another device", lambda e: lr(k=meta(rnd(B, T, H, K))), "`k` is on meta"),
    named("lr log_decay on another device", lambda e: lr(log_decay=meta(gates())), "`log_decay` is on meta"),
    named("lr initial_state of another shape", lambda e: lr(initial_state=rnd(2, H, K, V)), "`initial_state` must have shape"),
    named("lr initial_state integer", lambda e: lr(initial_state=torch.zeros(B, H, K, V, dtype=torch.long)),
          "`initial_state` must be a floating-point"),
    named("lr bonus of another shape", lambda e: lr(bonus=rnd(H, K + 1)), "`bonus` must have shape"),
    named("lr a without b", lambda e: lr(a=rnd(B, T, H, K)), "`a` and `b`"),
    named("lr a, b with beta", lambda e: lr(a=rnd(B, T, H, K), b=rnd(B, T, H, K), beta=torch.rand(B, T, H)),
          "mutually exclusive"),
    named("lr unknown backend", lambda e: lr(backend="cuda"), "unknown `backend` 'cuda'"),
    # linear_recurrence: gates
    named("lr log_decay NaN", lambda e: lr(log_decay=with_token(gates(), 1, NAN)), "`log_decay` must be <= 0 and not NaN"),
    named("lr log_decay +inf", lambda e: lr(log_decay=with_token(gates(), 1, INF)), "`log_decay` must be <= 0"),
    named("lr log_decay > 0", lambda e: lr(log_decay=with_token(gates(), 1, 0.5)), "`log_decay` must be <= 0"),
    named("lr log_decay of shape [B, T]", lambda e: lr(log_decay=torch.zeros(B, T)), "`log_decay` must be None or have shape"),
    named("lr log_decay integer", lambda e: lr(log_decay=torch.zeros(B, T, H, dtype=torch.long)), "`log_decay` must be a floating-point"),
    correct("lr log_decay -inf per token (chunk)", lambda e: recurrence_with_neg_inf_gate("scalar")),
    correct("lr log_decay -inf per channel (chunk)", lambda e: recurrence_with_neg_inf_gate("vector")),
    correct("lr log_decay -inf per head (chunk)", lambda e: recurrence_with_neg_inf_gate("constant")),
    correct("lr log_decay -3e38 (chunk)", lambda e: lr_pair(log_decay=with_token(gates(), 2, -3e38))),
    correct("lr log_decay 0 (no decay)", lambda e: lr_pair(log_decay=torch.zeros(B, T, H))),
    correct("lr log_decay -inf, delta rule", lambda e: lr_pair(log_decay=with_token(gates(), 2, -INF), beta=torch.rand(B, T, H))),
    correct("lr fp16 inputs, -inf gate", lambda e: [(a.float(), r.float()) for a, r in lr_pair(
        log_decay=with_token(gates(), 2, -INF), **qkv(dtype=torch.float16))][:1]),
    named("lr beta 2.5", lambda e: lr(beta=torch.full((B, T, H), 2.5)), "`beta` must be in [0, 2]"),
    named("lr beta -0.1", lambda e: lr(beta=torch.full((B, T, H), -0.1)), "`beta` must be in [0, 2]"),
    named("lr beta NaN", lambda e: lr(beta=with_token(torch.rand(B, T, H), 0, NAN)), "`beta` must be in [0, 2]"),
    named("lr beta of shape [B, T]", lambda e: lr(beta=torch.rand(B, T)), "`beta` must have shape"),
    correct("lr beta 0 (no write)", lambda e: lr_pair(beta=torch.zeros(B, T, H))),
    correct("lr beta 2 (upper edge)", lambda e: lr_pair(beta=torch.full((B, T, H), 2.0))),
    # linear_recurrence: scale
    named("lr scale NaN", lambda e: lr(scale=NAN), "`scale` must be a finite number > 0"),
    named("lr scale 0", lambda e: lr(scale=0.0), "`scale` must be a finite number > 0"),
    named("lr scale -1", lambda e: lr(scale=-1.0), "`scale` must be a finite number > 0"),
    named("lr scale inf", lambda e: lr(scale=INF), "`scale` must be a finite number > 0"),
    named("lr scale a tensor", lambda e: lr(scale=torch.tensor(0.5)), "`scale` must be a Python float"),
    named("lr scale True", lambda e: lr(scale=True), "`scale` must be a Python float"),
    # linear_recurrence: cu_seqlens and empty inputs
    named("lr cu_seqlens float", lambda e: lr(cu_seqlens=cu(0, 6, dtype=torch.float32)), "`cu_seqlens` must be int32 or int64"),
    named("lr cu_seqlens a list", lambda e: lr(cu_seqlens=[0, 6]), "`cu_seqlens` must be a torch.Tensor"),
    named("lr cu_seqlens not from 0", lambda e: lr(cu_seqlens=cu(1, 6)), "`cu_seqlens` must start at 0"),
    named("lr cu_seqlens falling", lambda e: lr(cu_seqlens=cu(0, 4, 2, 6)), "`cu_seqlens` must be non-decreasing"),
    named("lr cu_seqlens short of T", lambda e: lr(cu_seqlens=cu(0, 5)), "`cu_seqlens` must end at T = 6"),
    named("lr cu_seqlens past T", lambda e: lr(cu_seqlens=cu(0, 9)), "`cu_seqlens` must end at T = 6"),
    named("lr cu_seqlens one entry", lambda e: lr(cu_seqlens=cu(0)), "`cu_seqlens` must have shape [N + 1]"),
    named("lr cu_seqlens 2-D", lambda e: lr(cu_seqlens=cu(0, 6)[None]), "`cu_seqlens` must have shape [N + 1]"),
    named("lr cu_seqlens with B = 2", lambda e: lr(**qkv(b=2), cu_seqlens=cu(0, 6)), "`cu_seqlens` needs batch size B == 1"),
    named("lr cu_seqlens on another device", lambda e: lr(cu_seqlens=meta(cu(0, 6))), "`cu_seqlens`"),
    named("lr initial_state of B rows with cu_seqlens", lambda e: lr(initial_state=rnd(B, H, K, V), cu_seqlens=cu(0, 2, 6)),
          "`initial_state` must have shape"),
    correct("lr cu_seqlens with an empty sequence", lambda e: recurrence_empty_sequence()),
    correct("lr T = 0", lambda e: recurrence_empty_time()),
    correct("lr NaN key in a later chunk", lambda e: recurrence_nan_token_later_chunk()),
    # linear_recurrence_step
    named("step q 4-D", lambda e: step(q=rnd(B, 1, H, K)), "`q` must be 3-D"),
    named("step state of another shape", lambda e: step(state=torch.zeros(B, H, K, V + 1)), "`state` must have shape", fixed=True),
    named("step state integer", lambda e: step(state=torch.zeros(B, H, K, V, dtype=torch.long)), "`state` must be", fixed=True),
    named("step state a list", lambda e: step(state=[0.0]), "`state` must be a torch.Tensor", fixed=True),
    named("step state fp64 for fp32 inputs", lambda e: step(state=torch.zeros(B, H, K, V, dtype=torch.float64)),
          "`state` must be torch.float32"),
    named("step log_decay NaN", lambda e: step(log_decay=torch.full((B, H), NAN)), "`log_decay` must be <= 0"),
    named("step beta 3", lambda e: step(beta=torch.full((B, H), 3.0)), "`beta` must be in [0, 2]"),
    named("step scale NaN", lambda e: step(scale=NAN), "`scale` must be a finite number > 0"),
    correct("step log_decay -inf", lambda e: step_neg_inf_gate()),
    # forgetting_attention
    named("fa q 3-D", lambda e: fa(q=rnd(T, H, K)), "`q` must be 4-D"),
    named("fa heads not a multiple", lambda e: fa(q=rnd(B, T, 3, K)), "must be a multiple of the key/value heads"),
    named("fa k of another head dim", lambda e: fa(k=rnd(B, T, H, K + 1)), "`k` must have shape"),
    named("fa mixed dtypes", lambda e: fa(v=rnd(B, T, H, V, dtype=torch.float64)), "must share one dtype"),
    named("fa v on another device", lambda e: fa(v=meta(rnd(B, T, H, V))), "`v` is on meta"),
    named("fa log_forget > 0", lambda e: fa(log_forget=with_token(gates(), 1, 0.3)), "`log_forget` must be <= 0"),
    named("fa log_forget NaN", lambda e: fa(log_forget=with_token(gates(), 1, NAN)), "`log_forget` must not hold NaN", fixed=True),
    named("fa log_forget of shape [B, T]", lambda e: fa(log_forget=torch.zeros(B, T)), "`log_forget` must have shape"),
    named("fa log_forget integer", lambda e: fa(log_forget=torch.zeros(B, T, H, dtype=torch.long)), "`log_forget` must be a floating"),
    correct("fa log_forget -inf", lambda e: attention_neg_inf_gate(), fixed=True),
    named("fa window 0", lambda e: fa(window=0), "`window` must be >= 1"),
    named("fa window 2.5", lambda e: fa(window=2.5), "`window` must be a Python int"),
    named("fa window True", lambda e: fa(window=True), "`window` must be a Python int"),
    correct("fa window beyond T", lambda e: attention_huge_window()),
    named("fa scale NaN", lambda e: fa(scale=NAN), "`scale` must be a finite number > 0"),
    named("fa scale -2", lambda e: fa(scale=-2.0), "`scale` must be a finite number > 0"),
    named("fa cu_seqlens with B = 2", lambda e: fa(**qkv(b=2), cu_seqlens=cu(0, 6)), "`cu_seqlens` needs batch size B == 1"),
    named("fa cu_seqlens past T", lambda e: fa(cu_seqlens=cu(0, 7)), "`cu_seqlens` must end at T"),
    named("fa cu_seqlens float", lambda e: fa(cu_seqlens=cu(0, 6, dtype=torch.float64)), "`cu_seqlens` must be int32"),
    named("fa unknown backend", lambda e: fa(backend="flash"), "unknown `backend` 'flash'"),
    named("fa prune_tolerance 1.5", lambda e: fa(prune_tolerance=1.5), "`prune_tolerance` must lie in (0, 1)"),
    named("fa prune_tolerance 0", lambda e: fa(prune_tolerance=0.0), "`prune_tolerance` must lie in (0, 1)"),
    correct("fa T = 0", lambda e: attention_empty()),
    # bayes_filter
    named("bayes obs_noise None", lambda e: bf(obs_noise=None), "`obs_noise` is required"),
    named("bayes obs_noise 0", lambda e: bf(obs_noise=torch.zeros(B, T, H)), "`obs_noise` must be > 0"),
    named("bayes obs_noise NaN", lambda e: bf(obs_noise=torch.full((B, T, H), NAN)), "`obs_noise` must be > 0"),
    named("bayes obs_noise of shape [B, T]", lambda e: bf(obs_noise=torch.ones(B, T)), "`obs_noise` must have shape"),
    named("bayes log_decay NaN", lambda e: bf(log_decay=with_token(gates(), 0, NAN)), "`log_decay` must be <= 0"),
    named("bayes log_decay > 0", lambda e: bf(log_decay=with_token(gates(), 0, 1.0)), "`log_decay` must be <= 0"),
    correct("bayes log_decay -inf", lambda e: bayes_neg_inf_decay()),
    named("bayes process_noise -1", lambda e: bf(process_noise=torch.full((B, T, H), -1.0)), "`process_noise` must be >= 0"),
    named("bayes process_noise inf", lambda e: bf(process_noise=torch.full((B, T, H), INF)), "`process_noise`", fixed=True),
    correct("bayes obs_noise inf", lambda e: bayes_infinite_obs_noise()),
    named("bayes prior 0", lambda e: bf(prior=0.0), "`prior`"),
    named("bayes prior NaN", lambda e: bf(prior=NAN), "`prior`"),
    named("bayes prior inf", lambda e: bf(prior=INF), "`prior`", fixed=True),
    named("bayes prior a string", lambda e: bf(prior="1"), "`prior` must be a Python float"),
    named("bayes scale NaN", lambda e: bf(scale=NAN), "`scale` must be a finite number > 0", fixed=True),
    named("bayes scale 0", lambda e: bf(scale=0.0), "`scale` must be a finite number > 0", fixed=True),
    named("bayes scale -1", lambda e: bf(scale=-1.0), "`scale` must be a finite number > 0", fixed=True),
    named("bayes reset 'yes'", lambda e: bf(reset="yes"), "`reset` must be a bool"),
    named("bayes unknown backend", lambda e: bf(backend="cuda"), "`backend`"),
    named("bayes initial_state a tensor", lambda e: bf(initial_state=torch.zeros(B, H, K, V)), "`initial_state`"),
    named("bayes initial_state P of another shape", lambda e: bf(initial_state=(torch.zeros(B, H, K, V), torch.zeros(B, H, K, V + 1))),
          "`initial_state[1] (P)` must have shape"),
    named("bayes cu_seqlens falling", lambda e: bf(cu_seqlens=cu(0, 4, 2, 6)), "`cu_seqlens`"),
    named("bayes k on another device", lambda e: bf(k=meta(rnd(B, T, H, K))), "`k` is on meta"),
    # the Bayesian filter's conditioning: refused by name beyond what the backends compute exactly (docs/bayes.md)
    named("bayes obs_noise 1e-30 (T > K)", lambda e: bf(obs_noise=torch.full((B, T, H), 1e-30)), "`obs_noise` = 1e-30",
          fixed=True),
    named("bayes chunk obs_noise 1e-30", lambda e: bf(obs_noise=torch.full((B, T, H), 1e-30), backend="chunk"),
          "`obs_noise` = 1e-30", fixed=True),
    named("bayes triton obs_noise 1e-30", lambda e: bf(obs_noise=torch.full((B, T, H), 1e-30), backend="triton"),
          "`obs_noise` = 1e-30", fixed=True),
    named("bayes keys of norm 1e6", lambda e: bf(k=1e6 * F.normalize(rnd(B, T, H, K), dim=-1)), "|`k`|^2 = 1e+12", fixed=True),
    named("bayes chunk keys of norm 1e6", lambda e: bf(k=1e6 * F.normalize(rnd(B, T, H, K), dim=-1), backend="chunk"),
          "|`k`|^2 = 1e+12", fixed=True),
    named("bayes initial_state P not positive semi-definite", lambda e: bf(initial_state=bayes_state(not_a_covariance())),
          "`initial_state[1] (P)` must be a covariance", fixed=True),
    named("bayes chunk initial_state P not positive semi-definite",
          lambda e: bf(initial_state=bayes_state(not_a_covariance()), backend="chunk"),
          "`initial_state[1] (P)` must be a covariance", fixed=True),
    correct("bayes initial_state P singular", lambda e: bayes_singular_covariance()),
    correct("bayes reset with obs_noise 1e-30", lambda e: bayes_reset_tiny_obs_noise()),
    correct("bayes float64 obs_noise 1e-8", lambda e: bayes_float64_small_obs_noise()),
    named("bayes_filter_step obs_noise 1e-30", lambda e: bf_step(bayes_state(), obs_noise=torch.full((B, H), 1e-30)),
          "`obs_noise` = 1e-30", fixed=True),
    named("bayes_filter_step state P an expanded view",
          lambda e: bf_step(bayes_state(torch.eye(K).expand(B, H, K, K))), "`state[1] (P)` is updated in place", fixed=True),
    named("bayes_filter_step state M an inference tensor", lambda e: bf_step(inference_state()),
          "`state[0] (M)` is updated in place, but it is an inference tensor", fixed=True),
    # fused ops (reference backend on CPU)
    named("short_conv weight of other channels", lambda e: short_conv(rnd(1, 5, 8), rnd(7, 4)), "`weight` must be [C, W]"),
    named("short_conv x 2-D", lambda e: short_conv(rnd(5, 8), rnd(8, 4)), "`x` must be [B, T, C]"),
    named("short_conv activation relu", lambda e: short_conv(rnd(1, 5, 8), rnd(8, 4), activation="relu"), "`activation`"),
    named("short_conv cu_seqlens with B = 2", lambda e: short_conv(rnd(2, 5, 8), rnd(8, 4), cu_seqlens=cu(0, 5)), "`cu_seqlens`"),
    named("short_conv cu_seqlens short of T", lambda e: short_conv(rnd(1, 5, 8), rnd(8, 4), cu_seqlens=cu(0, 4)), "`cu_seqlens`"),
    named("short_conv initial_state of another shape", lambda e: short_conv(rnd(1, 5, 8), rnd(8, 4), initial_state=rnd(1, 4, 8)),
          "`initial_state` must be [N, W-1, C]"),
    named("short_conv unknown backend", lambda e: short_conv(rnd(1, 5, 8), rnd(8, 4), backend="cuda"), "`backend`"),
    correct("short_conv T = 0", lambda e: short_conv_empty()),
    named("short_conv_step state of another shape", lambda e: short_conv_step(rnd(1, 8), torch.zeros(1, 2, 8), rnd(8, 4)),
          "`state` must be [B, W-1, C]"),
    named("rms_norm weight of another size", lambda e: rms_norm(rnd(2, 8), torch.ones(7)), "`weight`"),
    named("rms_norm x integer", lambda e: rms_norm(torch.ones(2, 8, dtype=torch.long), torch.ones(8)), "`x` must be a floating"),
    named("rms_norm residual of another shape", lambda e: rms_norm(rnd(2, 8), torch.ones(8), residual=rnd(3, 8)), "`residual`"),
    named("rms_norm eps -1", lambda e: rms_norm(torch.zeros(2, 8), torch.ones(8), eps=-1.0), "`eps`", fixed=True),
    named("rms_norm eps NaN", lambda e: rms_norm(rnd(2, 8), torch.ones(8), eps=NAN), "`eps`", fixed=True),
    named("gated_rms_norm activation tanh", lambda e: gated_rms_norm(rnd(2, 8), rnd(2, 8), torch.ones(8), activation="tanh"),
          "`activation`"),
    named("gated_rms_norm eps -1", lambda e: gated_rms_norm(torch.zeros(2, 8), rnd(2, 8), torch.ones(8), eps=-1.0), "`eps`",
          fixed=True),
    named("l2_norm head_dim not a divisor", lambda e: l2_norm(rnd(2, 8), head_dim=3), "`head_dim` must divide"),
    named("l2_norm eps -1", lambda e: l2_norm(torch.zeros(2, 8), eps=-1.0), "`eps`", fixed=True),
    correct("l2_norm of a zero vector", lambda e: l2_norm_zero()),
    named("swiglu shapes differ", lambda e: swiglu(rnd(2, 8), rnd(2, 7)), "`up` must match gate"),
    named("swiglu integer gate", lambda e: swiglu(torch.ones(2, 8, dtype=torch.long), rnd(2, 8)), "`gate` must be a floating"),
    named("linear_cross_entropy label >= V", lambda e: linear_cross_entropy(rnd(4, 8), rnd(16, 8), torch.tensor([0, 1, 16, 2])),
          "`labels`", fixed=True),
    named("linear_cross_entropy label < 0", lambda e: linear_cross_entropy(rnd(4, 8), rnd(16, 8), torch.tensor([0, -3, 1, 2]),
                                                                             backend="reference"), "`labels`", fixed=True),
    named("linear_cross_entropy weight fp64", lambda e: linear_cross_entropy(rnd(4, 8), rnd(16, 8, dtype=torch.float64),
                                                                               torch.zeros(4, dtype=torch.long)), "`weight`"),
    named("linear_cross_entropy chunk_size 0", lambda e: linear_cross_entropy(rnd(4, 8), rnd(16, 8), torch.zeros(4, dtype=torch.long),
                                                                                chunk_size=0), "`chunk_size`"),
    named("linear_cross_entropy reduction none", lambda e: linear_cross_entropy(rnd(4, 8), rnd(16, 8),
                                                                                  torch.zeros(4, dtype=torch.long), reduction="none"),
          "`reduction`"),
    correct("linear_cross_entropy every label ignored (sum)", lambda e: lce_all_ignored()),
    # LinmemConfig
    named("config num_heads 0", lambda e: config(num_heads=0), "`num_heads`"),
    named("config hidden_size -16", lambda e: config(hidden_size=-16), "`hidden_size`"),
    named("config hidden_size '16'", lambda e: config(hidden_size="16"), "`hidden_size`"),
    named("config hidden_size True", lambda e: config(hidden_size=True), "`hidden_size`"),
    named("config hidden_size 16.0", lambda e: config(hidden_size=16.0), "`hidden_size`"),
    named("config vocab_size 0", lambda e: config(vocab_size=0), "`vocab_size`"),
    named("config conv_size 0", lambda e: config(mixer=dict(conv_size=0)), "`mixer.conv_size`"),
    named("config head_dim 0", lambda e: config(mixer=dict(head_dim=0)), "`mixer.head_dim`"),
    named("config expand_v 0", lambda e: config(mixer=dict(expand_v=0)), "`mixer.expand_v`"),
    named("config rms_norm_eps -1e-6", lambda e: config(rms_norm_eps=-1e-6), "`rms_norm_eps`"),
    named("config rms_norm_eps NaN", lambda e: config(rms_norm_eps=NAN), "`rms_norm_eps`"),
    named("config initializer_range -1", lambda e: config(initializer_range=-1.0), "`initializer_range`"),
    named("config rope_theta 0", lambda e: config(mixer=dict(rope_theta=0.0)), "`mixer.rope_theta`"),
    named("config window 0", lambda e: config(mixer=dict(window=0)), "`mixer.window`"),
    named("config use_short_conv 'yes'", lambda e: config(mixer=dict(use_short_conv="yes")), "`mixer.use_short_conv`"),
    named("config memory 'gla2'", lambda e: config(memory="gla2"), "unknown memory 'gla2'"),
    named("config attention 'flash'", lambda e: config(attention="flash"), "unknown attention 'flash'"),
    named("config mlp 'relu'", lambda e: config(mlp="relu"), "`mlp`"),
    named("config layer_pattern 'LXN'", lambda e: config(layer_pattern="LXN"), "layer_pattern 'LXN'"),
    named("config layer_pattern ''", lambda e: config(layer_pattern=""), "layer_pattern ''"),
    named("config layer_pattern a list", lambda e: config(layer_pattern=["L"]), "`layer_pattern`"),
    named("config typo windw", lambda e: config(mixer=dict(windw=16)), "did you mean 'mixer.window'?"),
    named("config flat window", lambda e: config(window=16), "give it as mixer={'window': ...}"),
    named("config section not a dict", lambda e: config(moe=4), "`moe` must be a dict"),
    named("config num_hidden_layers disagrees", lambda e: config(num_hidden_layers=3), "num_hidden_layers = 3"),
    named("config mom.top_k > num_memories", lambda e: config(memory="mom", mom=dict(top_k=5)), "`mom.top_k` = 5"),
    named("config pad_token_id = vocab_size", lambda e: config(pad_token_id=64), "`pad_token_id`"),
    named("config num_kv_heads not dividing", lambda e: config(layer_pattern="N", num_heads=4, mixer=dict(num_kv_heads=3)), "num_kv_heads"),
    named("config hidden_size not divisible by heads", lambda e: config(hidden_size=18, num_heads=4), "num_heads"),
    named("config recurrence_backend unknown", lambda e: config(recurrence_backend="cuda"), "`recurrence_backend`", fixed=True),
    named("config feature_map unknown", lambda e: config(memory="linear_attention", mixer=dict(feature_map="cosh")), "feature_map"),
    # model forward
    named("forward empty input", lambda e: forward(e, input_ids=torch.zeros(1, 0, dtype=torch.long)), "`input_ids` must be a non-empty"),
    named("forward id = vocab_size", lambda e: forward(e, input_ids=torch.tensor([[1, 64]])), "`input_ids` must lie in [0, vocab_size = 64)"),
    named("forward negative id", lambda e: forward(e, input_ids=torch.tensor([[-1, 2]])), "`input_ids` must lie"),
    named("forward float ids", lambda e: forward(e, input_ids=torch.ones(1, 3)), "`input_ids` must hold integer"),
    named("forward 1-D ids", lambda e: forward(e, input_ids=torch.ones(3, dtype=torch.long)), "`input_ids` must be a non-empty [B, T]"),
    named("forward ids and inputs_embeds", lambda e: forward(e, input_ids=ids(e, 1, 3), inputs_embeds=rnd(1, 3, 16)),
          "exactly one of `input_ids` and `inputs_embeds`"),
    named("forward inputs_embeds of another width", lambda e: forward(e, inputs_embeds=rnd(1, 3, 8)), "`inputs_embeds` must be"),
    named("forward attention_mask shorter than T", lambda e: forward(e, input_ids=ids(e, 1, 4), attention_mask=torch.ones(1, 2)),
          "`attention_mask`"),
    named("forward attention_mask 3-D", lambda e: forward(e, input_ids=ids(e, 1, 4), attention_mask=torch.ones(1, 1, 4)),
          "`attention_mask`"),
    named("forward attention_mask of another batch", lambda e: forward(e, input_ids=ids(e, 1, 4), attention_mask=torch.ones(2, 4)),
          "`attention_mask`", fixed=True),
    correct("forward float attention_mask of ones", float_mask_equals_none),
    named("forward cu_seqlens with B = 2", lambda e: forward(e, input_ids=ids(e, 2, 4), cu_seqlens=cu(0, 4), use_cache=False),
          "`cu_seqlens`"),
    named("forward cu_seqlens with a cache", lambda e: forward(e, input_ids=ids(e, 1, 4), cu_seqlens=cu(0, 4), use_cache=True),
          "`cu_seqlens`"),
    named("forward cu_seqlens past T", lambda e: forward(e, input_ids=ids(e, 1, 4), cu_seqlens=cu(0, 9), use_cache=False),
          "`cu_seqlens`"),
    named("forward cu_seqlens float", lambda e: forward(e, input_ids=ids(e, 1, 4), cu_seqlens=cu(0, 4, dtype=torch.float32),
                                                        use_cache=False), "`cu_seqlens`"),
    named("forward labels id >= vocab", lambda e: forward(e, input_ids=ids(e, 1, 4), labels=torch.tensor([[1, 2, 99, 3]])),
          "`labels`", fixed=True),
    named("forward labels of another shape", lambda e: forward(e, input_ids=ids(e, 1, 4), labels=ids(e, 1, 3)), "`labels`"),
    correct("forward packed sequences equal separate ones", packed_equals_separate),
    named("forward output_attentions=True", lambda e: forward(e, input_ids=ids(e, 1, 3), output_attentions=True),
          "`output_attentions` must be False", fixed=True),
    named("forward config output_attentions=True",
          lambda e: model_of(config(output_attentions=True))(ids(e, 1, 3)),
          "the config's `output_attentions`", fixed=True),
    named("forward shift_labels of another shape",
          lambda e: forward(e, input_ids=ids(e, 1, 4), labels=ids(e, 1, 4), shift_labels=ids(e, 1, 3)),
          "`shift_labels` must be integer token ids of the inputs' shape", fixed=True),
    named("forward shift_labels float", lambda e: forward(e, input_ids=ids(e, 1, 4), shift_labels=torch.ones(1, 4)),
          "`shift_labels` must be integer", fixed=True),
    correct("forward shift_labels win over labels", shift_labels_win, fixed=True),
    # from_pretrained
    named("from_pretrained missing folder", lambda e: from_pretrained(e.root / "no-such-model"), "no-such-model",
          (OSError, ValueError)),
    named("from_pretrained folder without weights",
          lambda e: from_pretrained(write_folder(e, "no-weights", {"config.json": config_json()})), "no-weights", (OSError,)),
    named("from_pretrained config.json not JSON",
          lambda e: from_pretrained(write_folder(e, "bad-json", {"config.json": "{nope"})), "config.json", (OSError, ValueError)),
    named("from_pretrained config num_heads 0",
          lambda e: from_pretrained(write_folder(e, "heads-0", {"config.json": config_json(num_heads=0)})), "`num_heads`"),
    named("from_pretrained garbage weights", lambda e: from_pretrained(broken_weights(e, b"\x00" * 64)), "model.safetensors",
          (OSError, ValueError), fixed=True),
    named("from_pretrained truncated weights", lambda e: from_pretrained(truncated_weights(e)), "model.safetensors",
          (OSError, ValueError), fixed=True),
    named("from_pretrained pickle payload weights", lambda e: from_pretrained(pickle_weights_folder(e)), "pytorch_model.bin",
          (OSError, ValueError), fixed=True),
    correct("from_pretrained LinmemModel folder (no lm_head)", load_base_model_as_causal_lm),
    correct("from_pretrained with an extra layer", load_with_extra_layer, fixed=True),
    correct("from_pretrained tied folder as untied", load_tied_as_untied),
    # checkpoints
    named("checkpoint without manifest", lambda e: verify(without(checkpoint(e, "no-manifest"), "manifest.json")),
          "no manifest.json", (RuntimeError,)),
    named("checkpoint manifest not JSON", lambda e: verify(rewrite(checkpoint(e, "bad-manifest"), "manifest.json", b"{")),
          "manifest.json is corrupted", (RuntimeError,)),
    named("checkpoint manifest {}", lambda e: verify(rewrite(checkpoint(e, "empty-manifest"), "manifest.json", b"{}")),
          "manifest.json lists []", (RuntimeError,)),
    named("checkpoint truncated weights", lambda e: verify(ckpt_truncated(e)), "model.safetensors is truncated", (RuntimeError,)),
    named("checkpoint flipped byte", lambda e: verify(ckpt_flipped(e)), "SHA-256 mismatch", (RuntimeError,)),
    named("checkpoint pickle payload optimizer.pt (manifest rewritten)",
          lambda e: _load_with_optimizer(e, rewrite(checkpoint(e, "pickle"), "optimizer.pt", pickle.dumps(Payload()),
                                                    manifest=True)),
          "optimizer.pt", (RuntimeError,), fixed=True),
    named("checkpoint into a model of another shape", lambda e: load_ckpt(e, checkpoint(e, "shape"), model=e.wider_model()),
          "does not fit the model", (RuntimeError,), fixed=True),
    named("checkpoint: none verifies", ckpt_all_invalid, "no checkpoint in", (RuntimeError,)),
    correct("checkpoint folder missing", ckpt_missing_dir),
    correct("checkpoint round trip", ckpt_round_trip),
    # trainer config and CLI (exit status 2, one line)
    named("cli train model.hidden_size=-1", lambda e: train_cli(e, "model.hidden_size=-1"), "hidden_size"),
    named("cli train model.hidden_size=abc", lambda e: train_cli(e, "model.hidden_size=abc"), "model.hidden_size"),
    named("cli train schedule.steps=0", lambda e: train_cli(e, "schedule.steps=0"), "schedule.steps"),
    named("cli train optim.lr=-1", lambda e: train_cli(e, "optim.lr=-1"), "optim.lr"),
    named("cli train optim.lr=nan", lambda e: train_cli(e, "optim.lr=nan"), "optim.lr"),
    named("cli train data.task=bogus", lambda e: train_cli(e, "data.task=bogus"), "data.task"),
    named("cli train data.tokens_per_batch=0", lambda e: train_cli(e, "data.task=text", "data.tokens_per_batch=0"),
          "tokens_per_batch"),
    named("cli train data.text.val_fraction=1.5", lambda e: train_cli(e, "data.task=text", "data.text.val_fraction=1.5"),
          "val_fraction"),
    named("cli train model.layer_pattern=LX", lambda e: train_cli(e, "model.layer_pattern=LX"), "layer_pattern"),
    named("cli train model.memroy=gla", lambda e: train_cli(e, "model.memroy=gla"), "did you mean 'memory'?"),
    named("cli train no '='", lambda e: train_cli(e, "schedule.steps"), "section.key=value"),
    named("cli train unknown recipe", lambda e: cli("train", "--recipe", "mqar-gdn"), "unknown recipe 'mqar-gdn'"),
    named("cli train missing config", lambda e: cli("train", "--config", str(e.root / "none.yaml")), "none.yaml not found"),
    named("cli train config not YAML",
          lambda e: cli("train", "--config", write_yaml(e, "a: [1")), "not valid YAML"),
    named("cli train run.device=tpu", lambda e: train_cli(e, "run.device=tpu"), "run.device"),
    named("cli train missing text path", lambda e: text_train(e, e.root / "no-such-corpus"), "no-such-corpus"),
    named("cli train empty corpus", empty_corpus, "holds no tokens"),
    named("cli generate missing run", lambda e: cli("generate", str(e.root / "no-run")), "no-run not found"),
    named("cli generate --max-new-tokens 0", lambda e: gen_cli(e, "--max-new-tokens", "0"), "max_new_tokens must be >= 1"),
    named("cli generate --max-new-tokens -5", lambda e: gen_cli(e, "--max-new-tokens", "-5"), "max_new_tokens must be >= 1"),
    named("cli generate --max-new-tokens abc", lambda e: gen_cli(e, "--max-new-tokens", "abc"), "--max-new-tokens"),
    named("cli generate --temperature -1", lambda e: gen_cli(e, "--temperature", "-1"), "temperature must be >= 0"),
    named("cli generate --temperature nan", lambda e: gen_cli(e, "--temperature", "nan"), "temperature must be >= 0"),
    named("cli generate --top-p 0", lambda e: gen_cli(e, "--top-p", "0"), "top_p must lie in (0, 1]"),
    named("cli generate --top-p 1.5", lambda e: gen_cli(e, "--top-p", "1.5"), "top_p must lie in (0, 1]"),
    named("cli generate --top-k 0", lambda e: gen_cli(e, "--top-k", "0"), "top_k must be >= 1"),
    named("cli generate non-UTF-8 --prompt", lambda e: gen_cli(e, "--prompt", "caf\udce9"), "--prompt is not valid UTF-8"),
    named("cli generate --stop ''", lambda e: gen_cli(e, "--stop", "", "--max-new-tokens", "1"), "stop must be a non-empty"),
    correct("cli generate empty prompt", cli_generate_empty_prompt),
    named("cli eval missing run", lambda e: cli("eval", str(e.root / "no-run")), "no-run not found"),
    # model folders: eval, generate and model.pretrained on folders that are not run directories
    named("model folders: from_pretrained a Llama folder", lambda e: from_pretrained(llama_folder(e)),
          "is a llama checkpoint, not a linmem model; run `linmem linearize --from", fixed=True),
    named("model folders: cli train model.pretrained=a Llama folder",
          lambda e: train_cli(e, f"model.pretrained={llama_folder(e)}"), "run `linmem linearize --from", fixed=True),
    named("model folders: cli train model.pretrained=a run directory",
          lambda e: train_cli(e, f"model.pretrained={e.run_dir}"), "a run directory keeps its model in", fixed=True),
    named("model folders: cli train model.pretrained=a missing folder",
          lambda e: train_cli(e, f"model.pretrained={e.root / 'no-model'}"), "no-model is not a saved model folder",
          fixed=True),
    named("model folders: cli eval a Llama folder", lambda e: cli("eval", str(llama_folder(e))),
          "run `linmem linearize --from"),
    named("model folders: cli generate a Llama folder", lambda e: cli("generate", str(llama_folder(e))),
          "run `linmem linearize --from"),
    named("model folders: cli eval a folder without config.yaml or config.json",
          lambda e: cli("eval", str(e.root / "corpus")),
          "neither a linmem run directory (no config.yaml) nor a model folder (no config.json)"),
    named("model folders: cli eval --suite mqar on a model folder",
          lambda e: cli("eval", str(e.run_dir / "model"), "--suite", "mqar"), "model folder without a training config"),
    named("model folders: cli eval data.task=mqar on a model folder",
          lambda e: cli("eval", str(e.run_dir / "model"), "data.task=mqar"), "is a model folder"),
    named("model folders: cli generate, no tokenizer and 64 tokens (bytes need 256)",
          lambda e: cli("generate", str(e.folder)), "data.text.tokenizer"),
    correct("model folders: cli generate from a saved model without a tokenizer (bytes)",
            lambda e: cli("generate", str(e.run_dir / "model"), "--prompt", "ab", "--max-new-tokens", "2",
                          "--temperature", "0")),
    named("cli data prepare missing path", lambda e: cli("data", "prepare", str(e.root / "prep"), str(e.root / "nothing")),
          "nothing"),
    named("cli tokenizer --vocab-size 10", lambda e: cli("tokenizer", "train", "--out", str(e.root / "t"), "--vocab-size", "10"),
          "vocab_size must be >="),
    # data
    named("data strict non-UTF-8 file", lambda e: non_utf8_files(e, "strict"), "latin1-strict.txt is not valid UTF-8"),
    correct("data non-UTF-8 file replaced", replaced_non_utf8),
    named("data errors='ignore'", lambda e: non_utf8_files(e, "ignore"), "errors must be 'replace' or 'strict'"),
    named("data missing path", lambda e: __import__("linmem.data.sources", fromlist=["x"]).list_text_files([e.root / "gone.txt"]),
          "gone.txt"),
    named("data val_fraction 1", lambda e: __import__("linmem.data.corpus", fromlist=["x"]).split_documents([1, 2], 1.0, 0),
          "val_fraction"),
    named("data all documents empty", lambda e: packed_batches([[], []]), "documents hold no tokens"),
    named("data tokens_per_batch 0", lambda e: packed_batches([[1, 2]], tokens=0), "tokens_per_batch must be >= 1"),
    named("data negative token id", lambda e: packed_batches([[1, -2]]), "token ids must be >= 0"),
    correct("data an empty document is skipped", corpus_with_empty_document),
    # tokenizer
    named("tokenizer vocab_size 100", lambda e: train_tok(e, 100), "vocab_size must be >= 258"),
    named("tokenizer min_frequency 0", lambda e: train_tok(e, 300, 0), "min_frequency must be >= 1"),
    named("tokenizer no text", lambda e: train_tok(e, 300, 2, [write_folder(e, "blank", {"a.txt": "  "})]), "no text to train on"),
    named("tokenizer missing folder", lambda e: __import__("linmem.data.codec", fromlist=["x"]).load_codec(e.root / "no-tok"),
          "no-tok"),
    named("tokenizer folder without tokenizer files", lambda e: tokenizer_folder(e, "not-a-tok", {"readme.txt": "x"}), "not-a-tok"),
    named("tokenizer byte id 300", lambda e: byte_codec().decode([300]), "byte token ids must lie in [0, 256)"),
    correct("tokenizer empty and cut text", lambda e: codec_round_trip()),
    # generation
    correct("generate empty prompt", generate_empty_prompt),
    named("generate temperature -1", lambda e: generate(e, temperature=-1.0), "temperature must be >= 0"),
    named("generate top_p 0", lambda e: generate(e, top_p=0.0), "top_p must lie in (0, 1]"),
    named("generate top_p 2", lambda e: generate(e, top_p=2.0), "top_p must lie in (0, 1]"),
    named("generate top_k 0", lambda e: generate(e, top_k=0), "top_k must be >= 1"),
    named("generate max_new_tokens 0", lambda e: generate(e, max_new_tokens=0), "max_new_tokens must be >= 1"),
    named("generate max_new_tokens -1", lambda e: generate(e, max_new_tokens=-1), "max_new_tokens must be >= 1"),
    named("generate stop ''", lambda e: generate(e, stop=""), "stop must be a non-empty"),
    named("generate non-UTF-8 prompt", lambda e: generate(e, "caf\udce9"), "prompt is not valid UTF-8"),
    named("model.generate empty input", lambda e: hf_generate(e, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2),
          "input_ids"),
    named("model.generate id out of vocabulary", lambda e: hf_generate(e, torch.tensor([[3, 64]]), max_new_tokens=2),
          "`input_ids` must lie"),
    named("model.generate max_new_tokens 0", lambda e: hf_generate(e, ids(e, 1, 4), max_new_tokens=0), "`max_new_tokens`"),
    # faults of the probe round: prepared shards, model folders, run configs and the command line
    named("cli train prepared shard, 4 bytes overwritten in place",
          lambda e: train_on_changed_shard(e, "shard-4-bytes", lambda size: b"\x01\x00\x02\x00"),
          "tokens_train_00000.bin does not match its SHA-256 sum", fixed=True),
    named("cli train prepared shard, all of it one valid token",
          lambda e: train_on_changed_shard(e, "shard-one-token", lambda size: b"a\x00" * (size // 2)),
          "tokens_train_00000.bin does not match its SHA-256 sum", fixed=True),
    named("from_pretrained folder without config.json",
          lambda e: from_pretrained(run_copy(e, "no-config-json", lambda d: (d / "model" / "config.json").unlink())
                                    / "model"), "model/config.json not found", (FileNotFoundError,), fixed=True),
    named("cli eval run whose model/ lacks config.json",
          lambda e: cli("eval", str(run_copy(e, "eval-no-config-json",
                                             lambda d: (d / "model" / "config.json").unlink()))),
          "config.json not found", fixed=True),
    named("cli train model.pretrained missing folder", lambda e: train_cli(e, f"model.pretrained={e.root / 'no-model'}"),
          "model.pretrained", fixed=True),
    named("cli train resume, run config.yaml broken YAML", lambda e: resume_with_config(e, "resume-bad-yaml", "model: [1,\n"),
          "config.yaml is not valid YAML (line 2, column 1", fixed=True),
    named("cli train resume, run config.yaml a list", lambda e: resume_with_config(e, "resume-list-yaml", "- 1\n"),
          "config.yaml must hold a mapping of sections", fixed=True),
    named("cli eval run config.yaml broken YAML",
          lambda e: cli("eval", str(run_copy(e, "eval-bad-yaml", lambda d: (d / "config.yaml").write_text("a: [1")))),
          "config.yaml is not valid YAML"),
    named("cli eval run config.yaml of a wrong type",
          lambda e: cli("eval", str(run_copy(e, "eval-type-yaml",
                                             lambda d: (d / "config.yaml").write_text("model:\n  hidden_size: abc\n")))),
          "config.yaml: model.hidden_size must be int", fixed=True),
    named("cli train --config not UTF-8", lambda e: cli("train", "--config", write_file(e, "binary.yaml", b"\xff\xfe\x80")),
          "binary.yaml is not a YAML text file", fixed=True),
    named("cli train --config a folder", lambda e: cli("train", "--config", str(e.root)), "is a folder", fixed=True),
    named("cli train run.out_dir a file", lambda e: cli("train", f"run.out_dir={write_file(e, 'out-file', b'x')}"),
          "run.out_dir", fixed=True),
    named("cli train run.log_every=0", lambda e: train_cli(e, "run.log_every=0"), "run.log_every must be >= 1", fixed=True),
    named("cli train run.save_every=-1", lambda e: train_cli(e, "run.save_every=-1"), "run.save_every must be >= 0",
          fixed=True),
    named("cli train run.seed=-1", lambda e: train_cli(e, "run.seed=-1"), "run.seed must lie in", fixed=True),
    named("cli train optim.weight_decay=-1", lambda e: train_cli(e, "optim.weight_decay=-1"), "optim.weight_decay",
          fixed=True),
    named("cli train optim.beta2=1", lambda e: train_cli(e, "optim.beta2=1"), "optim.beta1 and optim.beta2", fixed=True),
    named("cli train optim.eps=0", lambda e: train_cli(e, "optim.eps=0"), "optim.eps must be > 0", fixed=True),
    named("cli eval --device tpu", lambda e: cli("eval", str(e.run_dir), "--device", "tpu"), "device='tpu' is not a device",
          fixed=True),
    named("cli eval --device cuda:99", lambda e: cli("eval", str(e.run_dir), "--device", "cuda:99"), "device='cuda:99'",
          fixed=True),
    named("cli eval --batch-size 0", lambda e: cli("eval", str(e.run_dir), "--batch-size", "0"),
          "batch_size must be >= 1", fixed=True),
    named("cli tokenizer train --out a file",
          lambda e: cli("tokenizer", "train", "--out", write_file(e, "tok-file", b"x"), str(e.root / "corpus")),
          "(--out) is a file", fixed=True),
    named("cli demo --out a file", lambda e: cli("demo", "--quick", "--out", write_file(e, "demo-file", b"x")), "File exists",
          fixed=True),
    named("cli linearize --steps 0", lambda e: cli("linearize", "--from", str(e.root / "none"), "--out", str(e.root / "lin"),
                                                   "--lora-rank", "4", "--steps", "0"), "--steps must be >= 1", fixed=True),
    named("cli linearize --lr -1", lambda e: cli("linearize", "--from", str(e.root / "none"), "--out", str(e.root / "lin"),
                                                 "--lora-rank", "4", "--lr", "-1"), "--lr must be a finite number > 0",
          fixed=True),
    named("cli linearize --tokens-per-batch 0",
          lambda e: cli("linearize", "--from", str(e.root / "none"), "--out", str(e.root / "lin"), "--lora-rank", "4",
                        "--tokens-per-batch", "0"), "--tokens-per-batch must be >= 2", fixed=True),
    named("model.generate output_attentions=True",
          lambda e: hf_generate(e, ids(e, 1, 4), max_new_tokens=2, output_attentions=True,
                                return_dict_in_generate=True), "`output_attentions` must be False", fixed=True),
    correct("model.generate from inputs_embeds alone", generate_from_embeddings, fixed=True),
    # own text and the CLI
    named("cli train data.text.paths without brackets", lambda e: train_cli(e, "data.task=text", "data.text.paths=a.txt"),
          "write a list in brackets, e.g. data.text.paths=[a.txt]", fixed=True),
    named("cli train data.text.paths unclosed list", lambda e: train_cli(e, "data.task=text", "data.text.paths=[a.txt"),
          "data.text.paths='[a.txt': cannot read a list[str]", fixed=True),
    named("cli train val_fraction with prepared shards",
          lambda e: train_cli(e, "data.task=text", "data.text.prepared=p", "data.text.val_fraction=0.1"),
          "data.text.val_fraction=0.1 does not apply to data.text.prepared", fixed=True),
    named("cli train parallel.dp=2 on one process", lambda e: train_cli(e, "parallel.dp=2"),
          "launch with torchrun --nproc-per-node 2", fixed=True),
    named("cli train parallel.sp=2 on one process", lambda e: train_cli(e, "parallel.sp=2"),
          "launch with torchrun --nproc-per-node 2", fixed=True),
    correct("cli train schedule.steps=40 (warm-up scaled)",
            lambda e: __import__("linmem.train.config", fromlist=["x"]).load_config(
                overrides=["schedule.steps=40"]).schedule.warmup == 4, fixed=True),
    correct("cli train one text file (token-tail validation)",
            lambda e: own_text_run(e, "one-file", {"book.txt": "the quick brown fox. " * 40}), fixed=True),
    correct("cli train two files, one empty", lambda e: own_text_run(e, "one-empty-file",
                                                                     {"a.txt": "jumps over the dog. " * 40, "b.txt": ""}),
            fixed=True),
    named("cli eval run without validation data", lambda e: eval_cli(e, run=no_validation_run(e)),
          "has no validation data (validation: none (val_fraction 0))", fixed=True),
    named("cli eval position-loss --concat without validation data",
          lambda e: eval_cli(e, "--suite", "position-loss", "--concat", run=no_validation_run(e)),
          "has no validation data", fixed=True),
    named("cli eval position-loss windows longer than the data", lambda e: eval_cli(e, "--suite", "position-loss"),
          "give shorter --lengths", fixed=True),
    named("cli eval --depths 150", lambda e: eval_cli(e, "--suite", "niah", "--depths", "150"),
          "argument --depths: a count of evenly spaced depths must lie in [1, 101], got 150", fixed=True),
    named("cli eval --depths 0,150", lambda e: eval_cli(e, "--suite", "niah", "--depths", "0,150"),
          "argument --depths: depths are percentages in [0, 100]", fixed=True),
    named("cli eval --limit 0", lambda e: eval_cli(e, "--suite", "niah", "--limit", "0"), "--limit must be > 0"),
    named("cli eval niah --limit below its cells", lambda e: eval_cli(e, "--suite", "niah", "--limit", "5"),
          "--limit 5 is fewer prompts than the 9 (length, depth) cells"),
    named("cli tokenizer train --out a non-empty folder", tokenizer_into_full_folder, "full-folder (--out) exists",
          fixed=True),
    named("cli bench ops without CUDA", lambda e: bench_ops_without_cuda(), "no CUDA device found", fixed=True),
]


def _load_with_optimizer(env, path: Path) -> Any:
    from linmem.train.checkpoint import load_checkpoint

    model = env.model_copy()
    return load_checkpoint(path, model=model, optimizer=torch.optim.AdamW(model.parameters()))


# ---------------------------------------------------------------- the shared objects and the test

@pytest.fixture(scope="module")
def env(tmp_path_factory) -> SimpleNamespace:
    """One tiny model, its saved folders, one checkpoint and one run directory for every case."""
    from linmem.models import LinmemForCausalLM
    from linmem.train.checkpoint import save_checkpoint
    from linmem.train.config import load_config
    from linmem.train.runs import load_run

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("bad-inputs")
    model = LinmemForCausalLM(config()).eval()
    model.save_pretrained(root / "model")
    model.model.save_pretrained(root / "base")
    LinmemForCausalLM(config(tie_word_embeddings=True)).save_pretrained(root / "tied")
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpt = save_checkpoint(root / "checkpoints", 1, model=model, optimizer=optimizer, scheduler=scheduler,
                           trainer_state={}, rng_state={"torch": torch.get_rng_state()})
    run_dir = root / "run"
    run_dir.mkdir()
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 10)
    train_config = load_config(overrides=["data.task=text", f"data.text.paths=[{str(corpus)!r}]", "run.device=cpu"])
    (run_dir / "config.yaml").write_text(train_config.to_yaml())
    LinmemForCausalLM(config(vocab_size=256)).save_pretrained(run_dir / "model")

    def model_copy() -> LinmemForCausalLM:
        return LinmemForCausalLM(config()).eval()

    return SimpleNamespace(root=root, model=model, folder=root / "model", base_folder=root / "base",
                           tied_folder=root / "tied", checkpoint=ckpt, run_dir=run_dir, run=load_run(run_dir),
                           model_copy=model_copy, wider_model=lambda: LinmemForCausalLM(config(hidden_size=32)))


def _compare(result: Any, case: Case) -> None:
    assert result is True or isinstance(result, list), f"{case.name}: a correct case returns True or pairs, got {result!r}"
    if result is True:
        return
    for got, want in result:
        assert got.shape == want.shape, (case.name, got.shape, want.shape)
        assert got.isfinite().all(), f"{case.name}: non-finite result"
        if got.is_floating_point():
            bar = 5e-3 if got.dtype in (torch.float16, torch.bfloat16) else 1e-4
            assert rel_err(got, want) < bar or float((got.double() - want.double()).abs().max()) < 1e-6, case.name
        else:
            assert torch.equal(got, want), case.name


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, env: SimpleNamespace, capsys) -> None:
    if case.error is None:
        result = case.call(env)
        if isinstance(result, int) and not isinstance(result, bool):  # a command: status 0
            assert result == 0, capsys.readouterr().err
            return
        _compare(result, case)
        return
    try:
        result = case.call(env)
    except case.error as err:
        assert case.says in str(err), f"{case.name}: {type(err).__name__}: {err}"
        return
    # a command reports a refusal as status 2 and one line naming it
    assert isinstance(result, int) and not isinstance(result, bool), f"{case.name}: no error, returned {result!r}"
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(("linmem: error:", "usage:")) or "error:" in line]
    assert result == 2, f"{case.name}: status {result}; {err}"
    assert "Traceback" not in err and any(case.says in line for line in lines), f"{case.name}: {err}"


def test_catalogue_counts() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    assert len(CASES) >= 120


def summary() -> str:
    named_ = sum(c.outcome == "named" for c in CASES)
    fixed = sum(c.fixed for c in CASES)
    return (f"{len(CASES)} bad or edge inputs: {named_} named errors, {len(CASES) - named_} correct answers; "
            f"{fixed} were unclear crashes or silent wrong results before their validation")


if __name__ == "__main__":
    print(summary())
    sys.exit(0)
