"""Bad inputs of the unified recurrence raise errors that name the argument."""

from __future__ import annotations

import pytest
import torch

from linmem.ops import linear_recurrence, linear_recurrence_step, set_debug_checks

B, T, H, K, V = 2, 6, 3, 4, 5


def good(**over):
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V))
    x.update(over)
    return x


@pytest.mark.parametrize(
    "over, error, words",
    [
        (dict(k=torch.randn(B, T, H, K + 1)), ValueError, ["`k`", "[2, 6, 3, 4]", "[2, 6, 3, 5]"]),
        (dict(v=torch.randn(B, T + 1, H, V)), ValueError, ["`v`", "[B, T, H, V]"]),
        (dict(q=torch.randn(B, T, H)), ValueError, ["`q`", "4-D", "3-D"]),
        (dict(q=torch.randint(0, 3, (B, T, H, K))), TypeError, ["`q`", "floating", "int64"]),
        (dict(v=torch.randn(B, T, H, V, dtype=torch.float64)), TypeError, ["share one dtype"]),
        (dict(log_decay=-torch.rand(B, T)), ValueError, ["`log_decay`", "[B, T, H]", "[2, 6]"]),
        (dict(log_decay=torch.rand(B, T, H)), ValueError, ["`log_decay`", "<= 0"]),
        (dict(log_decay=-torch.rand(B, T, H).to(torch.int32)), TypeError, ["`log_decay`", "floating"]),
        (dict(beta=torch.rand(B, T, H, 1)), ValueError, ["`beta`", "[B, T, H]"]),
        (dict(bonus=torch.randn(K, H)), ValueError, ["`bonus`", "[H, K]", "[3, 4]", "[4, 3]"]),
        (dict(a=torch.randn(B, T, H, K)), ValueError, ["`a` and `b`"]),
        (dict(a=torch.randn(B, T, H, K), b=torch.randn(B, T, H, K), beta=torch.rand(B, T, H)), ValueError,
         ["mutually exclusive"]),
        (dict(initial_state=torch.randn(B, H, V, K)), ValueError, ["`initial_state`", "[N, H, K, V]"]),
        (dict(cu_seqlens=torch.tensor([0, 3, 6])), ValueError, ["`cu_seqlens`", "B == 1"]),
        (dict(scale="0.5"), TypeError, ["`scale`"]),
        (dict(scale=float("nan")), ValueError, ["`scale`", "finite number > 0", "nan"]),
        (dict(scale=float("inf")), ValueError, ["`scale`", "finite number > 0", "inf"]),
        (dict(scale=0.0), ValueError, ["`scale`", "> 0", "0.0"]),
        (dict(scale=-1), ValueError, ["`scale`", "> 0", "-1"]),
        (dict(log_decay=torch.full((B, T, H), float("nan"))), ValueError, ["`log_decay`", "not NaN", "NaN"]),
        (dict(log_decay=torch.full((H,), float("inf"))), ValueError, ["`log_decay`", "[-inf, 0]", "inf"]),
        (dict(beta=torch.full((B, T, H), 2.5)), ValueError, ["`beta`", "[0, 2]", "maximum of 2.5"]),
        (dict(beta=torch.full((B, T, H), -0.1)), ValueError, ["`beta`", "[0, 2]", "minimum of -0.1"]),
        (dict(beta=torch.full((B, T, H), float("nan"))), ValueError, ["`beta`", "[0, 2]", "NaN"]),
    ],
    ids=lambda x: None,
)
def test_bad_inputs_raise_named_errors(over, error, words):
    with pytest.raises(error) as info:
        linear_recurrence(**good(**over))
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.parametrize(
    "cu, words",
    [
        ([1, 3, 6], ["start at 0"]),
        ([0, 4, 2, 6], ["non-decreasing"]),
        ([0, 3, 5], ["end at T = 6"]),
        ([[0, 6]], ["[N + 1]"]),
    ],
)
def test_bad_cu_seqlens(cu, words):
    x = good(q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, H, V))
    with pytest.raises(ValueError) as info:
        linear_recurrence(**x, cu_seqlens=torch.tensor(cu))
    for word in words:
        assert word in str(info.value)


def test_float_cu_seqlens_is_a_type_error():
    x = good(q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, H, V))
    with pytest.raises(TypeError, match="int32 or int64"):
        linear_recurrence(**x, cu_seqlens=torch.tensor([0.0, 6.0]))


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match="reference, chunk"):
        linear_recurrence(**good(), backend="cuda")


def test_initial_state_counts_sequences_under_varlen():
    x = good(q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, H, V))
    with pytest.raises(ValueError, match="N = number of sequences"):
        linear_recurrence(**x, cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, H, K, V))


def test_range_edges_are_accepted():
    """-inf gates (forget everything), beta 0 and 2, and a tiny scale are valid inputs."""
    g = torch.full((B, T, H), -0.5)
    g[:, 2] = float("-inf")
    beta = torch.zeros(B, T, H)
    beta[..., 0] = 2.0
    o, _ = linear_recurrence(**good(log_decay=g, beta=beta), scale=1e-30)
    assert torch.isfinite(o).all()


def test_debug_switch_toggles_value_checks_only_for_device_tensors():
    set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match="<= 0"):
            linear_recurrence(**good(log_decay=torch.full((H,), 0.5)))
    finally:
        set_debug_checks(False)
    with pytest.raises(ValueError, match="<= 0"):  # CPU tensors are always value-checked
        linear_recurrence(**good(log_decay=torch.full((H,), 0.5)))


def test_decode_step_errors():
    S = torch.zeros(B, H, K, V)
    with pytest.raises(ValueError, match="3-D"):
        linear_recurrence_step(torch.randn(B, 1, H, K), torch.randn(B, H, K), torch.randn(B, H, V), S)
    with pytest.raises(TypeError, match="`state` must be torch.float32"):
        linear_recurrence_step(torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, V), S.double())
    with pytest.raises(ValueError, match="`state` must have shape"):
        linear_recurrence_step(torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, V), S[:, :, :, :2])
