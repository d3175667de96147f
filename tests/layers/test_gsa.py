"""Gated slot attention: the op equals a token-by-token loop of the paper's equations (outputs, final
states, gradients), continues from a state, keeps packed sequences apart, decodes step by step and
leaves the state untouched at masked tokens; the mixer serves GQA and is no MoM rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.layers import build_mixer
from linmem.layers.gsa import GSAArgs, slot_attention_with_cache
from linmem.layers.mom import mom_rules
from linmem.ops.gsa import gated_slot_attention, gated_slot_attention_step, reference_gated_slot_attention
from tests.helpers import rel_err

B, T, H, K, V, M = 2, 11, 2, 8, 6, 4

@pytest.fixture(autouse=True)
def one_cpu_thread():
    """Tiny layers run on one intra-op thread (on a shared CPU two threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    log_decay = F.logsigmoid(2 * torch.randn(B, T, H, M, generator=g, dtype=dtype))
    return q, k, v, log_decay


def test_gsa_equals_the_loop_in_outputs_states_and_gradients():
    q, k, v, g = (x.requires_grad_() for x in inputs())
    o, (keys, values) = gated_slot_attention(q, k, v, g, output_final_state=True)
    ref, (ref_keys, ref_values) = reference_gated_slot_attention(q, k, v, g, scale=K ** -0.5)
    for got, want in ((o, ref), (keys, ref_keys), (values, ref_values)):
        assert rel_err(got.detach(), want.detach()) < 1e-10
    w = torch.randn_like(o)
    grads = torch.autograd.grad((o * w).sum(), (q, k, v, g))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v, g))
    for name, a, b in zip("qkvg", grads, ref_grads):
        assert rel_err(a, b) < 1e-10, name


def test_gsa_in_two_pieces_and_step_by_step_equals_one_pass():
    q, k, v, g = inputs(torch.float32)
    full, _ = gated_slot_attention(q, k, v, g)
    o1, state = gated_slot_attention(q[:, :5], k[:, :5], v[:, :5], g[:, :5], output_final_state=True)
    o2, _ = gated_slot_attention(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], initial_state=state)
    assert rel_err(torch.cat([o1, o2], 1), full) < 1e-5
    steps = []
    for t in range(5, T):
        o, state = gated_slot_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], state)
        steps.append(o)
    assert rel_err(torch.stack(steps, 1), full[:, 5:]) < 1e-5


def test_gsa_packed_sequences_equal_each_alone():
    q, k, v, g = (x[:1] for x in inputs(torch.float32))
    cu = torch.tensor([0, 4, 11])
    packed, _ = gated_slot_attention(q, k, v, g, cu_seqlens=cu)
    for a, b in zip(cu[:-1], cu[1:]):
        alone, _ = gated_slot_attention(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b])
        assert rel_err(packed[:, a:b], alone) < 1e-5


def test_masked_tokens_leave_the_state_untouched():
    from linmem.layers import LayerState

    q, k, v, g = inputs(torch.float32)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:6] = False
    cache = LayerState()
    slot_attention_with_cache(q, k, v, g, scale=None, cache=cache, token_mask=mask, cu_seqlens=None, backend="auto")
    keep = torch.cat([torch.arange(3), torch.arange(6, T)])
    _, (keys, values) = gated_slot_attention(q[:1, keep], k[:1, keep], v[:1, keep], g[:1, keep],
                                             output_final_state=True)
    assert rel_err(cache.get("slot_keys")[:1], keys) < 1e-5 and rel_err(cache.get("recurrent")[:1], values) < 1e-5


def test_gsa_mixer_serves_gqa_and_is_no_mom_rule():
    mixer = build_mixer("gsa", GSAArgs(hidden_size=32, num_heads=4, num_kv_heads=2, num_slots=8))
    assert mixer.f_proj.out_features == 2 * 8 and mixer.k_proj.out_features == 2 * 8
    assert mixer(torch.randn(2, 5, 32)).shape == (2, 5, 32)
    assert "gsa" not in mom_rules()


def test_bad_inputs_are_named():
    q, k, v, g = inputs(torch.float32)
    with pytest.raises(ValueError, match="log_decay"):
        gated_slot_attention(q, k, v, g[..., 0])
    with pytest.raises(ValueError, match="num_slots"):
        build_mixer("gsa", GSAArgs(hidden_size=32, num_heads=2, num_slots=0))
