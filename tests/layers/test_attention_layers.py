"""The attention mixers beyond the shared invariants: the sliding-window ring buffer, the "Pro"
options on every attention mixer, FoX's forget-gate variants, GQA, RoPE positions under padding,
padding inside the cache."""

from __future__ import annotations

import logging

import pytest
import torch

from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers import attention
from linmem.layers.attention import DECAY_TIME_RANGE
from linmem.models import LinmemConfig, LinmemForCausalLM
from linmem.ops import attention as attention_ops
from linmem.ops.attention import cumulative_forget
from linmem.ops.attention.reference import reference_attention
from linmem.ops.fused import reference as fused_reference

D, H = 32, 4
TOL = 1e-4
PRO = ("qk_norm", "output_gate", "output_norm", "kv_shift")


def make(name: str, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mixer(name, MixerArgs(hidden_size=D, num_heads=H, **over)).eval()


def max_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def decode(m, x, prefill: int, **kw):
    """Prefill ``prefill`` tokens, then one token per call; the concatenated outputs."""
    cache = LayerState()
    parts = [m(x[:, :prefill], cache=cache, **kw)]
    parts += [m(x[:, t : t + 1], cache=cache, **kw) for t in range(prefill, x.shape[1])]
    return torch.cat(parts, 1), cache


@torch.no_grad()
def test_swa_ring_buffer_is_constant_size_and_exact():
    m = make("swa", window=4, num_kv_heads=2)
    x = torch.randn(2, 19, D)
    out, cache = decode(m, x[:, :3], prefill=2)
    size = cache.nbytes()
    assert cache.get("k").shape == (2, 4, 2, D // H)
    for t in range(3, 19):  # far more than `window` decoded tokens
        out = torch.cat([out, m(x[:, t : t + 1], cache=cache)], 1)
        assert cache.nbytes() == size
    assert cache.seen_tokens == 19
    assert max_err(out, m(x)) < TOL


@torch.no_grad()
def test_softmax_cache_grows_in_blocks_and_counts_tokens(monkeypatch):
    monkeypatch.setattr(attention, "GROW_SLOTS", 4)
    m = make("softmax")
    x = torch.randn(1, 9, D)
    out, cache = decode(m, x, prefill=5)  # 8 slots after the prefill, 12 from the 9th token on
    assert cache.seen_tokens == 9 and cache.get("k").shape[1] == 12 and int(cache.get("key_mask").sum()) == 9
    assert max_err(out, m(x)) < TOL


@pytest.mark.parametrize("name", ["softmax", "swa", "fox"])
@pytest.mark.parametrize("option", PRO)
def test_each_pro_option_changes_the_output(name, option):
    x = torch.randn(2, 11, D)
    with torch.no_grad():
        assert max_err(make(name, window=6, **{option: True})(x), make(name, window=6)(x)) > 1e-3


ALL_PRO = {o: True for o in PRO}
CASES = [("fox", {}), *(("fox", {o: True}) for o in PRO), ("fox", {**ALL_PRO, "num_kv_heads": 2, "window": 5}),
         ("fox", {"forget_gate": "data_independent"}), ("fox", {"forget_gate": "fixed", **ALL_PRO}),
         ("softmax", {**ALL_PRO, "num_kv_heads": 2}), ("swa", {**ALL_PRO, "window": 5}),
         ("fox", {"rope": True, "num_kv_heads": 2}), ("softmax", {"rope": False}), ("swa", {"rope": False, "window": 5}),
         ("fox", {"prune_tolerance": 0.01})]
CASE_IDS = ["fox", *(f"fox-{o}" for o in PRO), "fox-all+gqa+window", "fox-data_independent", "fox-fixed+pro",
            "softmax-pro+gqa", "swa-pro", "fox-rope+gqa", "softmax-no-rope", "swa-no-rope", "fox-pruned"]


@pytest.mark.parametrize("name, over", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_decode_and_chunked_prefill_equal_forward(name, over):
    m = make(name, **over)
    x = torch.randn(2, 14, D)
    full = m(x)
    assert max_err(decode(m, x, prefill=5)[0], full) < TOL
    cache = LayerState()
    chunks = [m(x[:, a:b], cache=cache) for a, b in ((0, 3), (3, 10), (10, 14))]
    assert max_err(torch.cat(chunks, 1), full) < TOL


@pytest.mark.parametrize("name, over", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_varlen_and_left_padding(name, over):
    m = make(name, **over)
    xs = [torch.randn(1, n, D) for n in (6, 1, 9)]
    cu = torch.tensor([0, 6, 7, 16])
    packed = m(torch.cat(xs, 1), cu_seqlens=cu)
    for i, x in enumerate(xs):
        assert max_err(packed[:, cu[i] : cu[i + 1]], m(x)) < TOL
    padded = torch.cat([torch.zeros(1, 4, D), xs[2]], 1)
    mask = torch.arange(13)[None] >= 4
    positions = (torch.arange(13) - 4).clamp_min(0)[None]
    assert max_err(m(padded, token_mask=mask, position_ids=positions)[:, 4:], m(xs[2])) < TOL


def test_fox_gate_variants():
    """data_independent: a learnt constant per head starting at decay times spread over DECAY_TIME_RANGE;
    fixed: those constants, no parameter; data_dependent: sigmoid(w^T x + b) per token."""
    x = torch.randn(2, 5, D)
    learnt, fixed, dependent = (make("fox", forget_gate=g) for g in ("data_independent", "fixed", "data_dependent"))
    times = -1 / fixed.log_forget(x)[0, 0]  # [H] decay times 1 / -log f_h
    assert torch.allclose(times[[0, -1]], torch.tensor(DECAY_TIME_RANGE), rtol=1e-4)
    assert bool((times.diff() > 0).all()) and torch.equal(fixed.log_forget(x)[0, 0], fixed.log_forget(x)[1, 4])
    assert not any("f_" in n for n, _ in fixed.named_parameters())
    assert torch.allclose(learnt.log_forget(x), fixed.log_forget(x)) and learnt.f_bias.requires_grad
    f = dependent.log_forget(x)
    assert torch.allclose(f, torch.nn.functional.logsigmoid(x @ dependent.f_proj.weight.T + dependent.f_proj.bias))


@pytest.mark.parametrize("over", [{}, {"num_kv_heads": 1}, {"num_kv_heads": 2}], ids=["mha", "mqa", "gqa"])
@torch.no_grad()
def test_softmax_rope_is_position_consistent_under_left_padding(over):
    m = make("softmax", **over)
    x = torch.randn(1, 8, D)
    ref = m(x)
    pad = 5
    padded = torch.cat([torch.randn(1, pad, D), x], 1)  # even garbage in the padding is ignored
    mask = torch.arange(pad + 8)[None] >= pad
    positions = (torch.arange(pad + 8) - pad).clamp_min(0)[None]
    out = m(padded, token_mask=mask, position_ids=positions)
    assert max_err(out[:, pad:], ref) < TOL
    shifted = m(x, position_ids=torch.arange(8)[None] + 1000)  # RoPE only sees relative positions
    assert max_err(shifted, ref) < TOL
    cache = LayerState()
    pre = m(padded[:, : pad + 3], cache=cache, token_mask=mask[:, : pad + 3], position_ids=positions[:, : pad + 3])
    dec = [m(padded[:, t : t + 1], cache=cache, position_ids=positions[:, t : t + 1]) for t in range(pad + 3, pad + 8)]
    assert max_err(torch.cat([pre, *dec], 1)[:, pad:], ref) < TOL


@pytest.mark.parametrize("name, over", [("softmax", {}), ("fox", {o: True for o in PRO})], ids=["softmax", "fox"])
@torch.no_grad()
def test_right_padding_inside_the_cache_is_skipped(name, over):
    """Prefill a right-padded batch row, then decode: as if the padding had never been there."""
    m = make(name, **over)
    x = torch.randn(1, 9, D)
    ref = m(x)
    padded = torch.cat([x[:, :5], torch.zeros(1, 3, D), x[:, 5:]], 1)  # 3 pads after 5 real tokens
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[:, 5:8] = False
    positions = torch.cat([torch.arange(5), torch.full((3,), 4), torch.arange(5, 9)])[None]
    cache = LayerState()
    pre = m(padded[:, :8], cache=cache, token_mask=mask[:, :8], position_ids=positions[:, :8])
    dec = [m(padded[:, t : t + 1], cache=cache, position_ids=positions[:, t : t + 1]) for t in range(8, 12)]
    out = torch.cat([pre[:, :5], *dec], 1)
    assert max_err(out, ref) < TOL


@pytest.mark.parametrize("name", ["softmax", "swa", "fox"])
def test_fully_padded_row_is_finite(name):
    m = make(name, window=3, **({o: True for o in PRO} if name == "fox" else {})).train()
    x = torch.randn(2, 7, D, requires_grad=True)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1] = False
    out = m(x, token_mask=mask)
    out.square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    with torch.no_grad():
        assert max_err(out[:1], m(x[:1])) < TOL


def test_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        make("swa")
    with pytest.raises(ValueError, match="multiple of `num_kv_heads` = 3"):
        make("softmax", num_kv_heads=3)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1))


@pytest.mark.parametrize("name, rope", [("softmax", None), ("softmax", True), ("softmax", False), ("swa", False),
                                        ("fox", None), ("fox", False), ("fox", True)])
@torch.no_grad()
def test_rope_switch_is_the_reference_op_on_rotated_or_raw_q_k(name, rope):
    """``rope`` (None: on for softmax and swa, off for fox) rotates q and k before the attention, and nothing else:
    the mixer equals the reference attention op (with FoX's cumulative forget values) over q, k rotated by the
    reference RoPE, or over q, k as projected."""
    window = 5 if name == "swa" else None
    m = make(name, rope=rope, num_kv_heads=2, window=window)
    assert m.rotary == (rope if rope is not None else name != "fox") == hasattr(m, "rope")
    x = torch.randn(2, 12, D)
    q, k, v = _heads(m.q_proj(x), H), _heads(m.k_proj(x), 2), _heads(m.v_proj(x), 2)
    if m.rotary:
        q, k = fused_reference.rotary(q, k, torch.arange(12).expand(2, 12), 10000.0)
    forget = cumulative_forget(m.log_forget(x)) if name == "fox" else None
    o = reference_attention(q, k, v, scale=(D // H) ** -0.5, cum_forget=forget, window=window)
    assert max_err(m(x), m.o_proj(o.flatten(2))) < TOL


def test_rope_switch_keeps_the_defaults_and_is_checked():
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        for name in ("softmax", "fox"):
            assert torch.equal(make(name)(x), make(name, rope=None)(x))
        assert max_err(make("fox", rope=True)(x), make("fox")(x)) > 1e-3
        assert max_err(make("softmax", rope=False)(x), make("softmax")(x)) > 1e-3
    with pytest.raises(ValueError, match="`rope` must be True or False or None, got 1"):
        make("fox", rope=1)
    with torch.no_grad():
        assert max_err(make("llama_attention", rope=False)(x), make("llama_attention")(x)) > 1e-3


@torch.no_grad()
def test_fox_prune_tolerance_moves_outputs_by_less_than_the_tolerance():
    """mixer.prune_tolerance reaches forgetting_attention: on a long sequence with strong forget gates the pruned
    attention output moves by less than 2 eps max|v| (the op's bound), it does move (pairs are dropped), a larger
    tolerance moves it more, and a decoding step over a cache (which does not prune) continues the same layer."""
    T, eps = 384, 1e-3
    plain, pruned, loose = (make("fox", prune_tolerance=p) for p in (None, eps, 0.5))
    for m in (plain, pruned, loose):
        m.f_proj.bias.fill_(-2.0)  # forget gates near 0.12: the forget bias drops distant keys
        m.o_proj.weight.copy_(torch.eye(D))  # the output is the attention output o
    x = torch.randn(1, T, D)
    bound = 2 * eps * float(plain.v_proj(x).abs().max())
    exact = plain(x)
    moved, moved_more = float((pruned(x) - exact).abs().max()), float((loose(x) - exact).abs().max())
    assert 0 < moved < bound and moved_more > moved
    assert max_err(decode(pruned, x[:, :40], prefill=30)[0], plain(x[:, :40])) < 1e-3


def test_prune_tolerance_is_refused_by_name():
    for bad in (-0.1, 0.0, 1.0, True):
        with pytest.raises(ValueError, match="`prune_tolerance` must"):
            make("fox", prune_tolerance=bad)
    for name, over in (("softmax", {}), ("swa", {"window": 4}), ("llama_attention", {})):
        with pytest.raises(ValueError, match=f"{name}: has no forget gate, so `prune_tolerance`"):
            make(name, prune_tolerance=0.01, **over)


WIDTHS = [(1024, 4, None, "fox", {}), (1024, 16, None, "swa", {"window": 6}),
          (1024, 8, 96, "softmax", {"num_kv_heads": 2})]


@pytest.mark.parametrize("hidden, heads, head_dim, name, over", WIDTHS, ids=["4x256-fox", "16x64-swa", "8x96-gqa"])
def test_head_dims_take_the_kernels_in_training_prefill_and_decoding(hidden, heads, head_dim, name, over, monkeypatch,
                                                                     caplog):
    """A model of width 1024 with 4 heads of 256, 16 of 64 or 8 of 96 sends every attention call to the Triton
    kernels as ``backend="auto"`` does on CUDA: the flash kernels in training and in the prefill, the decoding
    kernel for each step of a static cache; nothing falls back. On CPU the kernels run in the interpreter, and the
    CUDA order of the backends stands in for the device; on CUDA the model runs in bf16 (its steps may replay from
    a CUDA graph, so only the eager calls are counted)."""
    from types import SimpleNamespace

    from tests.helpers import triton_kernels_device

    device = triton_kernels_device()
    if device == "cpu":
        cuda_order = attention_ops._candidates
        monkeypatch.setattr(attention_ops, "_candidates",
                            lambda backend, q: cuda_order(backend, SimpleNamespace(device=torch.device("cuda"))))
    calls = {"flash_attention": 0, "decode_attention": 0}
    for fn in calls:
        def spy(*args, _run=getattr(attention_ops._triton, fn), _name=fn):
            calls[_name] += 1
            return _run(*args)
        monkeypatch.setattr(attention_ops._triton, fn, spy)
    torch.manual_seed(0)
    config = LinmemConfig(vocab_size=64, hidden_size=hidden, num_heads=heads, intermediate_size=64,
                          layer_pattern="N", attention=name, mixer=dict(head_dim=head_dim, **over))
    model = LinmemForCausalLM(config).to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    ids = torch.randint(1, 64, (2, 9), device=device)
    with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
        model(ids, labels=ids).loss.backward()
        assert calls == {"flash_attention": 1, "decode_attention": 0}
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # a left-padded row: the prefill attends with a key mask
        with torch.no_grad():
            out = model.eval().generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                        cache_implementation="static")
    assert out.shape == (2, 12)
    assert "cannot serve" not in caplog.text, caplog.text
    # the prefill (9 query rows per KV head, at most cached_attention's DECODE_ROWS) and two steps: decoding kernel
    if device == "cpu":
        assert calls == {"flash_attention": 1, "decode_attention": 3}
    else:
        assert calls["flash_attention"] == 1 and calls["decode_attention"] >= 1
