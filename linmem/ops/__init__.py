"""Math on tensors: no nn.Module, no parameters."""

from .bayes import bayes_filter, bayes_filter_step
from .recurrence import (
    available_backends,
    linear_recurrence,
    linear_recurrence_step,
    register_backend,
    set_debug_checks,
)

__all__ = [
    "linear_recurrence",
    "linear_recurrence_step",
    "register_backend",
    "available_backends",
    "set_debug_checks",
    "bayes_filter",
    "bayes_filter_step",
]
