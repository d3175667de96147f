"""Named values of the kernels' compile-time switches.

Launchers pass a switch as a member of its enum (an ``int``); kernels compare it with the constexpr of the same
name below, since a Triton kernel reads a module global only when it is a ``tl.constexpr``. The two spellings
hold the same numbers, which the compiled code sees.
"""

from __future__ import annotations

import enum

import triton.language as tl


class Decay(enum.IntEnum):
    """The kind of gate: the ``DECAY`` switch of the kernels."""

    NONE = 0  # no decay
    SCALAR = 1  # one gate per token and head: g [tokens, H]
    CHANNEL = 2  # one gate per token, head and key channel: g [tokens, H, K]
    CONSTANT = 3  # one gate per head, g [H], read as given (the recurrent kernel; the chunk kernels take it expanded)

    @classmethod
    def of(cls, decay_kind: str) -> Decay:
        """The chunk kernels' kind of a ``RecurrenceInputs.decay_kind`` ("none", "constant", "scalar", "vector"): a
        constant decay reaches them expanded per token, as a scalar one."""
        return {"none": cls.NONE, "constant": cls.SCALAR, "scalar": cls.SCALAR, "vector": cls.CHANNEL}[decay_kind]


NO_DECAY: tl.constexpr = tl.constexpr(Decay.NONE.value)
SCALAR_DECAY: tl.constexpr = tl.constexpr(Decay.SCALAR.value)
CHANNEL_DECAY: tl.constexpr = tl.constexpr(Decay.CHANNEL.value)
CONSTANT_DECAY: tl.constexpr = tl.constexpr(Decay.CONSTANT.value)


class Side(enum.IntEnum):
    """Which gradients of a chunk one launch of ``grads.grads_kernel`` computes: its ``SIDE`` switch."""

    BOTH = 0  # dq, dk, the gate and bonus gradients
    QUERY = 1  # dq, and a scalar decay's row sums q dq for the key side
    KEY = 2  # dk, the bonus gradient, and the gate gradient from the query side's row sums


BOTH_SIDES: tl.constexpr = tl.constexpr(Side.BOTH.value)
QUERY_SIDE: tl.constexpr = tl.constexpr(Side.QUERY.value)
KEY_SIDE: tl.constexpr = tl.constexpr(Side.KEY.value)
