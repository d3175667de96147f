"""Mixture of memories: one memory, top-1, no shared memory is the plain rule; the recurrence runs
once over all (sequence, memory) pairs; decoding leaves unrouted memories bit-identical; prefill +
decode, varlen and left padding keep their invariants for every rule; the balancing loss follows
its formula. (tests/layers/test_mixers.py checks the default MoM like every registered mixer.)"""

from __future__ import annotations

import pytest
import torch

import linmem.layers.recurrent as recurrent_module
from linmem.layers import LayerState, MixerArgs, build_mixer
from linmem.layers.mom import MoMArgs, mom_rules

D, H = 32, 2
RULES = mom_rules()


def make(rule: str, **over) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_mixer("mom", MoMArgs(hidden_size=D, num_heads=H, mom_memory=rule, use_short_conv=True, **over)).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("rule", RULES)
def test_one_memory_top1_without_shared_memory_is_the_plain_rule(rule):
    mom = make(rule, num_memories=1, top_k=1, shared_memory=False)
    torch.manual_seed(1)
    plain = build_mixer(rule, MixerArgs(hidden_size=D, num_heads=H, use_short_conv=True)).eval()
    mine = mom.memory.state_dict()
    with torch.no_grad():
        for name, value in plain.state_dict().items():
            mine[name].copy_(value.reshape(mine[name].shape))  # per-memory weights carry a memory axis of 1
        x, cu = torch.randn(2, 11, D), torch.tensor([0, 4, 11])
        assert rel(mom(x), plain(x)) < 1e-5
        assert rel(mom(x[:1], cu_seqlens=cu), plain(x[:1], cu_seqlens=cu)) < 1e-5


def test_the_recurrence_runs_once_over_every_sequence_memory_pair(monkeypatch):
    mom = make("gated_deltanet", num_memories=4, top_k=2)
    calls = []
    original = recurrent_module.linear_recurrence

    def counted(*args, **kwargs):
        calls.append(kwargs["cu_seqlens"])
        return original(*args, **kwargs)

    monkeypatch.setattr(recurrent_module, "linear_recurrence", counted)
    with torch.no_grad():
        mom(torch.randn(3, 10, D))
    assert len(calls) == 1
    cu = calls[0]
    assert cu.numel() == 5 * 3 + 1 and int(cu[-1]) == 3 * 10 * (2 + 1)  # (4 + shared) x 3 pairs; k + 1 per token
    assert cu.diff().view(5, 3)[4].tolist() == [10, 10, 10]  # the shared memory sees every token


def test_decoding_leaves_the_unrouted_memories_bit_identical():
    mom = make("gla", num_memories=4, top_k=1)
    x = torch.randn(2, 12, D)
    cache = LayerState()
    with torch.no_grad():
        mom(x[:, :4], cache=cache)
        for t in range(4, 12):
            before = {name: tensor.clone() for name, tensor in cache.tensors.items()}
            mom(x[:, t: t + 1], cache=cache)
            routed = mom.router_stats.logits.argmax(-1)  # [B]: the one memory of each row
            for b in range(2):
                for m in range(5):
                    same = [torch.equal(cache.get(n)[b, m], before[n][b, m]) for n in before]
                    if m == int(routed[b]) or m == 4:  # routed or shared: the state moved
                        assert not same[list(before).index("recurrent")]
                    else:
                        assert all(same), f"step {t}, row {b}, memory {m} changed"


@pytest.mark.parametrize("rule", RULES)
def test_prefill_decode_varlen_and_left_padding(rule):
    mom = make(rule)
    x = torch.randn(2, 10, D)
    with torch.no_grad():
        full = mom(x)
        cache = LayerState()
        parts = [mom(x[:, :3], cache=cache), mom(x[:, 3:6], cache=cache)]
        parts += [mom(x[:, t: t + 1], cache=cache) for t in range(6, 10)]
        assert rel(torch.cat(parts, 1), full) < 1e-4, "prefill + decode"

        cu = torch.tensor([0, 10, 16])
        packed = mom(torch.cat([x[:1], x[1:, :6]], 1), cu_seqlens=cu)
        assert rel(packed[:, :10], full[:1]) < 1e-4 and rel(packed[:, 10:], mom(x[1:, :6])) < 1e-4, "varlen"

        padded = torch.cat([torch.zeros(1, 3, D), x[:1]], 1)
        mask = torch.ones(1, 13, dtype=torch.bool)
        mask[0, :3] = False
        assert rel(mom(padded, token_mask=mask)[:, 3:], full[:1]) < 1e-4, "left padding"


def test_balancing_loss_is_memories_times_sum_of_load_times_probability():
    mom = make("gated_deltanet", num_memories=4, top_k=2)
    x = torch.randn(2, 9, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :2] = False
    with torch.no_grad():
        mom(x, token_mask=mask)
    probs = (x[mask] @ mom.router.weight.T).softmax(-1)  # [16, 4]
    chosen = probs.topk(2, dim=-1).indices
    f = torch.stack([(chosen == m).any(-1).float().mean() for m in range(4)])
    torch.testing.assert_close(mom.router_stats.balance_loss, 4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(mom.router_stats.load, f)


def test_bad_arguments_name_the_valid_choices():
    with pytest.raises(ValueError, match="valid: bayes, deltanet, gated_deltanet, gateloop, gfw, gla"):
        make("rwkv7")
    with pytest.raises(ValueError, match=r"`top_k` = 3 must lie in \[1, num_memories = 2\]"):
        make("gla", num_memories=2, top_k=3)


def test_inactive_parameters_are_the_unrouted_memories_projections():
    mom = make("deltanet", num_memories=4, top_k=1)
    per_memory = 2 * D * D + D * H  # k, v [D, H * D / H] and b [D, H] projections of one memory
    assert mom.inactive_parameter_count() == 3 * per_memory
