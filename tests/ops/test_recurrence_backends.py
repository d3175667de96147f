"""The backend registry: a backend is a function of one RecurrenceInputs; a refusal falls back to
"chunk" with the reason logged."""

from __future__ import annotations

import logging

import torch

from linmem.ops import Backend, RecurrenceInputs, available_backends, linear_recurrence, register_backend
from linmem.ops.recurrence import backends
from linmem.ops.recurrence.chunk import chunk_recurrence
from tests.helpers import make_inputs


def test_a_registered_backend_gets_the_validated_inputs_and_a_refusal_falls_back(caplog):
    seen: list[RecurrenceInputs] = []

    def recording(inputs: RecurrenceInputs):
        seen.append(inputs)
        return chunk_recurrence(inputs)

    register_backend(Backend("recording", recording, lambda x: "no delta rule" if x.rule == "delta" else None))
    try:
        assert "recording" in available_backends()
        t = make_inputs("constant", "additive", False, B=1, T=5, H=2, K=4, V=3)
        o, S = linear_recurrence(**t, output_final_state=True, backend="recording")
        assert len(seen) == 1 and seen[0].decay_kind == "constant" and seen[0].scale == 0.5
        assert seen[0].output_final_state and seen[0].initial_state is t["initial_state"]
        o_ref, S_ref = linear_recurrence(**t, output_final_state=True, backend="chunk")
        assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
        with caplog.at_level(logging.DEBUG, logger="linmem.ops"):
            linear_recurrence(**t, beta=torch.rand(1, 5, 2), backend="recording")
        assert len(seen) == 1 and "'recording' cannot serve these inputs (no delta rule)" in caplog.text
    finally:
        del backends._BACKENDS["recording"]
