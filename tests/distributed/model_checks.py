"""Checks run on every rank: whole models under sequence parallelism equal the one-process model.

Packed rows whose sequences cross ranks, hybrids of every kind of token mixing that crosses a rank
boundary: recurrences, short convolutions and token shifts (the halo), sliding-window, full and
forgetting attention (with KV-shift). Logits of each rank's piece and the parameter gradients
(averaged over the ranks, as data parallelism averages them) must match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from linmem.distributed import SequenceParallel, global_lm_loss, next_token_targets, sequence_parallel, shard_sequence
from linmem.models import LinmemConfig, LinmemForCausalLM
from tests.helpers import rel_err

TOL = 1e-5  # fp64 models keep some fp32 steps (norms, gates)
HYBRIDS = [
    ("gated_deltanet", "swa", {}),
    ("rwkv6", "fox", {"kv_shift": True}),
    ("gla", "fox", {"kv_shift": True, "qk_norm": True}),
    ("mamba2", "softmax", {}),
    ("rwkv7", "swa", {}),
]


def model_checks() -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    T = 8 * world
    bounds = [0, 3, T - 5, T - 2, T] if world == 2 else [0, 3, 20, 26, T]
    ids = torch.randint(0, 32, (1, T), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor(bounds)}
    piece, layout = shard_sequence(batch, rank, world)
    mine = slice(rank * (T // world), (rank + 1) * (T // world))
    for memory, attention, extra in HYBRIDS:
        case = f"{memory} + {attention} {extra}, world {world}"
        torch.manual_seed(0)
        model = LinmemForCausalLM(LinmemConfig(
            vocab_size=32, hidden_size=16, num_heads=2, layer_pattern="LNL", memory=memory, attention=attention,
            mixer=dict(window=5, **extra), recurrence_backend="chunk")).double()
        ref = model(ids, cu_seqlens=batch["cu_seqlens"], use_cache=False).logits
        global_lm_loss(ref, next_token_targets(ids, batch["cu_seqlens"]), None).backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        with sequence_parallel(SequenceParallel(dist.group.WORLD, layout, piece["cu_seqlens"])):
            logits = model(piece["input_ids"], position_ids=piece["position_ids"], cu_seqlens=piece["cu_seqlens"],
                           use_cache=False).logits
            global_lm_loss(logits, piece["targets"], dist.group.WORLD).backward()
        err = rel_err(logits, ref[:, mine])
        assert err < TOL, f"{case}: logits differ from the one-process model ({err:.1e})"
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            if ref_grads[name].abs().max() > 0:
                err = rel_err(grad / world, ref_grads[name])
                assert err < TOL, f"{case}: d{name} differs from the one-process model ({err:.1e})"
