"""Property-based: over random shapes, decay kinds, rules and chunk sizes, chunk == reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linmem.ops import linear_recurrence
from linmem.ops.recurrence.chunk import chunk_recurrence
from tests.helpers import DECAY_KINDS, RULES, make_inputs, rel_err
from tests.ops.test_recurrence import validated


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3), T=st.integers(1, 80), H=st.integers(1, 3), K=st.integers(1, 12), V=st.integers(1, 12),
    kind=st.sampled_from(DECAY_KINDS), rule=st.sampled_from(RULES), bonus=st.booleans(),
    chunk_size=st.sampled_from([1, 3, 16, 64]), with_state=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_chunk_matches_reference_on_random_shapes(B, T, H, K, V, kind, rule, bonus, chunk_size, with_state, seed):
    gen = torch.Generator().manual_seed(seed)
    t = make_inputs(kind, rule, bonus, B=B, T=T, H=H, K=K, V=V, generator=gen, initial_state=with_state)
    o_ref, S_ref = linear_recurrence(**t, output_final_state=True, backend="reference")
    o, S = chunk_recurrence(validated(t), chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-4
    assert rel_err(S, S_ref) < 1e-4
