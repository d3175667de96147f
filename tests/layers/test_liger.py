"""Liger Attention: equals a token-by-token loop of its equations (GLA memory + window softmax, GQA),
every memory variant decodes through its ring buffer and state as its forward and stays finite under
huge keys, the branch weights and ablations do what they say, the gate pooling is Liger's adaptive
average pooling, the RoPE scalings are transformers', and bad options are named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import LayerState, build_mixer
from linmem.layers.liger import (
    LIGER_MEMORIES,
    MIN_LOG_DECAY,
    LigerArgs,
    PretrainedAttentionArgs,
    pool_channels,
)
from linmem.ops.fused.reference import rope_frequencies
from tests.helpers import rel_err

D, H, HKV = 32, 4, 2

@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny layers run on one intra-op thread (on a shared CPU two threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def liger(**over) -> torch.nn.Module:
    torch.manual_seed(0)
    args = LigerArgs(hidden_size=D, num_heads=H, num_kv_heads=HKV, liger_window=3, qk_norm=True, qkv_bias=True,
                     **over)
    mixer = build_mixer("liger", args).eval()
    with torch.no_grad():  # q/k norms off their init, so that they count
        mixer.q_norm.weight.uniform_(0.5, 1.5)
        mixer.k_norm.weight.uniform_(0.5, 1.5)
    return mixer


def loop_liger_gla(mixer, x: torch.Tensor) -> torch.Tensor:
    """y_t = W_o (w phi(q_t) S_t + (1 - w) sum_{t-W<j<=t} softmax_j(RoPE q_t . RoPE k_j / sqrt d) v_j),
    S_t = diag(sigmoid(k_t)^(1/16)) S_{t-1} + phi(k_t)^T v_t, phi = softmax over the head dim."""
    a = mixer.args
    B, T = x.shape[:2]
    K, W, w = a.key_dim, a.liger_window, a.liger_memory_weight
    q, k, v = mixer.project(x)
    k, v = (x.repeat_interleave(H // HKV, dim=2) for x in (k, v))
    positions = torch.arange(T).expand(B, T)
    q_rot, k_rot = mixer.rope.pair(q, k, positions)
    state = x.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        alpha = torch.sigmoid(k[:, t]) ** (1 / 16)
        state = alpha[..., None] * state + torch.softmax(k[:, t], -1)[..., None] * v[:, t, :, None, :]
        memory = torch.einsum("bhk,bhkv->bhv", torch.softmax(q[:, t], -1), state)
        start = max(0, t - W + 1)
        scores = torch.einsum("bhd,bjhd->bhj", q_rot[:, t], k_rot[:, start:t + 1]) / math.sqrt(K)
        window = torch.einsum("bhj,bjhv->bhv", torch.softmax(scores, -1), v[:, start:t + 1])
        out.append(w * memory + (1 - w) * window)
    return mixer.o_proj(torch.stack(out, 1).flatten(2))


def loop_liger_mlstm(mixer, x: torch.Tensor) -> torch.Tensor:
    """The memory branch alone (liger_memory_weight=1): y_t = W_o phi(q_t) S_t with
    S_t = f_t S_{t-1} + i_t phi(k_t)^T v_t, f_t = sigmoid(g_t), i_t = min(exp(g_t), 20), g_t = mean_k k_t."""
    B, T = x.shape[:2]
    q, k, v = mixer.project(x)
    k, v = (x.repeat_interleave(H // HKV, dim=2) for x in (k, v))
    state = x.new_zeros(B, H, D // H, v.shape[-1])
    out = []
    for t in range(T):
        g = k[:, t].mean(-1)[..., None, None]  # [B, H, 1, 1]
        write = torch.exp(g).clamp_max(20.0) * torch.softmax(k[:, t], -1)[..., None] * v[:, t, :, None, :]
        state = torch.sigmoid(g) * state + write
        out.append(torch.einsum("bhk,bhkv->bhv", torch.softmax(q[:, t], -1), state))
    return mixer.o_proj(torch.stack(out, 1).flatten(2))


def test_liger_mlstm_equals_the_token_loop_and_packs_sequences():
    """Liger's mLSTM row against its token loop (keys shifted so that the input-gate cap binds on some tokens),
    and packed sequences (cu_seqlens) as each alone."""
    mixer = liger(liger_memory="mlstm", liger_memory_weight=1.0).double()
    with torch.no_grad():
        mixer.k_norm.weight.mul_(torch.linspace(0.0, 12.0, D // H, dtype=torch.float64))
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(mixer(x), loop_liger_mlstm(mixer, x)) < 1e-10
        g = mixer.project(x)[1].mean(-1)
        assert (g > math.log(20)).any() and (g < math.log(20)).any()
        xs = [torch.randn(1, n, D, dtype=torch.float64) for n in (5, 1, 7)]
        packed = mixer(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 5, 6, 13]))
        assert rel_err(packed, torch.cat([mixer(x) for x in xs], 1)) < 1e-10


def test_liger_gla_equals_the_token_loop():
    mixer = liger(liger_memory_weight=0.3).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(mixer(x), loop_liger_gla(mixer, x)) < 1e-10


@pytest.mark.parametrize("memory", LIGER_MEMORIES)
def test_every_memory_decodes_through_its_cache_as_its_forward(memory):
    mixer = liger(liger_memory=memory, num_slots=4 if memory == "gsa" else None)
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        full = mixer(x)
        cache = LayerState()
        parts = [mixer(x[:, :4], cache=cache)] + [mixer(x[:, t:t + 1], cache=cache) for t in range(4, 9)]
    assert rel_err(torch.cat(parts, 1), full) < 1e-5
    assert cache.get("k").shape[1] == 3  # the window's ring: W slots, however long the sequence


@pytest.mark.parametrize("memory", LIGER_MEMORIES)
def test_huge_keys_give_finite_outputs_and_gradients(memory):
    mixer = liger(liger_memory=memory, num_slots=4 if memory == "gsa" else None).train()
    with torch.no_grad():
        mixer.k_proj.weight.mul_(1e3)
        mixer.k_norm.weight.mul_(1e3)
    x = torch.randn(1, 40, D, requires_grad=True)
    y = mixer(x)
    y.square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


#: Liger Table 1 as decays alpha of the pooled key g (gamma = 1/4: layer 1 of 4); gla and gated retention with
#: Liger's code's gate_logit_normalizer 16
TABLE_1 = {
    "gla": lambda g: torch.sigmoid(g) ** (1 / 16),
    "gated_retention": lambda g: torch.sigmoid(g[..., 0]) ** (1 / 16),
    "mamba2": lambda g: torch.exp(-F.softplus(g[..., 0])),
    "rwkv6": lambda g: torch.exp(-torch.exp(g)),
    "hgrn2": lambda g: 0.25 + 0.75 * torch.sigmoid(g),
    "mlstm": lambda g: torch.sigmoid(g[..., 0]),
}


@pytest.mark.parametrize("memory", list(TABLE_1))
def test_decays_follow_table_1_and_hgrn2_writes_one_minus_its_decay(memory):
    mixer = liger(liger_memory=memory, layer_idx=1, num_layers=4)
    gate = 2 * torch.randn(2, 6, H, 1 if memory in ("mamba2", "gated_retention") else D // H)
    k = torch.randn(2, 6, H, D // H)
    log_decay, key = mixer.decay_and_key(gate, k)
    torch.testing.assert_close(log_decay.exp(), TABLE_1[memory](gate))
    if memory == "hgrn2":  # key = 1 - alpha
        torch.testing.assert_close(key, 1 - TABLE_1[memory](gate))
    elif memory == "mlstm":  # the input gate exp(g), capped at 20, scales phi(k)
        torch.testing.assert_close(key, torch.exp(gate).clamp_max(20.0) * torch.softmax(k, -1))
    else:
        torch.testing.assert_close(key, torch.softmax(k, -1))
    log_decay, _ = mixer.decay_and_key(50 * gate, k)
    assert (log_decay <= 0).all() and (log_decay.clamp_min(MIN_LOG_DECAY) >= MIN_LOG_DECAY).all()


def test_branch_weights_zero_and_one():
    x = torch.randn(2, 7, D)
    window_only = liger(liger_memory_weight=0.0)
    attention = build_mixer("llama_attention", PretrainedAttentionArgs(
        hidden_size=D, num_heads=H, num_kv_heads=HKV, window=3, qk_norm=True, qkv_bias=True)).eval()
    attention.load_state_dict(window_only.state_dict())
    with torch.no_grad():
        assert torch.equal(window_only(x), attention(x))
        cache = LayerState()
        liger(liger_memory_weight=1.0)(x, cache=cache)
    assert set(cache.tensors) == {"recurrent"}  # no window branch: no KV ring


def test_ablations_add_only_their_parameters_and_start_where_liger_starts():
    base = liger()
    names = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}  # noqa: E731
    projection = liger(liger_gate="projection")
    assert set(names(projection)) - set(names(base)) == {"gate_proj.weight"}
    assert names(projection)["gate_proj.weight"] == (HKV * (D // H), D)
    learnable = liger(liger_feature_map="learnable")
    assert set(names(learnable)) - set(names(base)) == {"feature_map.weight"}
    learnable.load_state_dict(base.state_dict(), strict=False)
    x = torch.randn(1, 5, D)
    with torch.no_grad():
        torch.testing.assert_close(learnable(x), base(x))  # an identity W_h is the softmax feature map


def test_pooling_is_adaptive_average_pooling_of_the_key():
    k = torch.randn(3, 5, HKV, 16)
    for size in (16, 4, 1):
        liger_pool = torch.nn.AdaptiveAvgPool1d(HKV * size)(k.flatten(2)).unflatten(-1, (HKV, size))
        torch.testing.assert_close(pool_channels(k, size), liger_pool)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_frequencies_equal_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_theta": 5e5, **scaling})
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    torch.testing.assert_close(rope_frequencies(64, 5e5, scaling), expected.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("over,message", [
    (dict(liger_memory="lstm"), "liger_memory"),
    (dict(liger_memory_weight=1.5), "liger_memory_weight"),
    (dict(liger_window=0), "liger_window"),
    (dict(liger_memory="gsa", liger_feature_map="learnable"), "liger_feature_map"),
    (dict(liger_memory="gsa", num_slots=3), "num_slots"),
    (dict(rope_scaling_params={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (dict(rope_scaling_params={"rope_type": "linear"}), "factor"),
])
def test_bad_options_are_named(over, message):
    with pytest.raises(ValueError, match=message):
        build_mixer("liger", LigerArgs(hidden_size=D, num_heads=H, **over))


def test_llama_attention_refuses_the_pro_options():
    with pytest.raises(ValueError, match="kv_shift"):
        build_mixer("llama_attention", PretrainedAttentionArgs(hidden_size=D, num_heads=H, kv_shift=True))
