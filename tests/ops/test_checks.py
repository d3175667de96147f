"""The shared input checks: every op that takes ``cu_seqlens`` refuses a bad one with the same words and its
own name; values are read on CPU tensors and not under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linmem.ops import bayes_filter, linear_recurrence
from linmem.ops.attention import forgetting_attention
from linmem.ops.checks import check_cu_seqlens
from linmem.ops.fused import short_conv
from linmem.ops.gsa import gated_slot_attention

T = 6


def _qkv(B: int = 1) -> dict:
    return dict(q=torch.randn(B, T, 2, 4), k=torch.randn(B, T, 2, 4), v=torch.randn(B, T, 2, 4))


OPS = {
    "linear_recurrence": lambda B, cu: linear_recurrence(**_qkv(B), cu_seqlens=cu),
    "forgetting_attention": lambda B, cu: forgetting_attention(**_qkv(B), cu_seqlens=cu, backend="reference"),
    "bayes_filter": lambda B, cu: bayes_filter(**_qkv(B), log_decay=-torch.rand(B, T, 2),
                                               obs_noise=torch.ones(B, T, 2), cu_seqlens=cu),
    "short_conv": lambda B, cu: short_conv(torch.randn(B, T, 8), torch.randn(8, 4), cu_seqlens=cu),
    # GSA reaches the checks through its first recurrence
    "linear_recurrence (gsa)": lambda B, cu: gated_slot_attention(
        **_qkv(B), log_decay=F.logsigmoid(torch.randn(B, T, 2, 3)), cu_seqlens=cu),
}

BAD = [
    (1, torch.tensor([0.0, 6.0]), TypeError, "`cu_seqlens` must be int32 or int64"),
    (1, [0, 6], TypeError, "`cu_seqlens` must be a torch.Tensor"),
    (1, torch.tensor([0]), ValueError, "`cu_seqlens` must have shape [N + 1]"),
    (2, torch.tensor([0, 6]), ValueError, "`cu_seqlens` needs batch size B == 1"),
    (1, torch.tensor([1, 6]), ValueError, "`cu_seqlens` must start at 0"),
    (1, torch.tensor([0, 4, 2, 6]), ValueError, "`cu_seqlens` must be non-decreasing"),
    (1, torch.tensor([0, 5]), ValueError, f"`cu_seqlens` must end at T = {T}"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("B, cu, error, says", BAD, ids=[says for *_, says in BAD])
def test_every_op_refuses_a_bad_cu_seqlens_in_the_same_words(op, B, cu, error, says):
    with pytest.raises(error) as caught:
        OPS[op](B, cu)
    assert str(caught.value).startswith(op.split(" ")[0] + ": ") and says in str(caught.value)


def test_cu_seqlens_values_are_not_read_under_compile():
    def count(cu: torch.Tensor) -> torch.Tensor:
        return cu.new_tensor(check_cu_seqlens("op", cu, 1, T, cu.device))

    compiled = torch.compile(count, backend="eager", fullgraph=True)
    assert int(compiled(torch.tensor([0, 4, 2, 9]))) == 3  # the values are wrong, but nothing reads them
    with pytest.raises(ValueError, match="must be non-decreasing"):
        count(torch.tensor([0, 4, 2, 6]))
