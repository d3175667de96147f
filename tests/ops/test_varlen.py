"""The packed-batch index maps against torch.searchsorted, eager and compiled."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linmem.ops.varlen import count_at_or_below, positions_in_sequence, sequence_ids


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_maps_equal_searchsorted(lengths: list[int]) -> None:
    """Empty sequences (repeated boundaries) included, first and last."""
    cu = torch.tensor([0] + lengths).cumsum(0)
    T = int(cu[-1])
    steps = torch.arange(T)
    expected_ids = torch.searchsorted(cu[1:], steps, right=True)
    assert torch.equal(sequence_ids(cu, T), expected_ids)
    assert torch.equal(sequence_ids(cu.to(torch.int32), T), expected_ids)
    assert torch.equal(positions_in_sequence(T, cu, cu.device), steps - cu[expected_ids])
    ends = cu[1:]
    assert torch.equal(count_at_or_below(ends, T + 3), torch.searchsorted(ends, torch.arange(T + 3), right=True))


def test_compiled_maps_equal_eager() -> None:
    cu = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)
    compiled = torch.compile(lambda c: (positions_in_sequence(12, c, c.device), sequence_ids(c, 12)), fullgraph=True)
    for got, expected in zip(compiled(cu), (positions_in_sequence(12, cu, cu.device), sequence_ids(cu, 12))):
        assert torch.equal(got, expected)
