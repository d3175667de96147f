"""Math on tensors: no nn.Module, no parameters."""

from .bayes import bayes_filter, bayes_filter_step
from .checks import set_debug_checks
from .recurrence import (
    Backend,
    RecurrenceInputs,
    StepKernel,
    available_backends,
    linear_recurrence,
    linear_recurrence_step,
    register_backend,
    register_step_kernel,
)

__all__ = [
    "linear_recurrence",
    "linear_recurrence_step",
    "Backend",
    "StepKernel",
    "RecurrenceInputs",
    "register_backend",
    "register_step_kernel",
    "available_backends",
    "set_debug_checks",
    "bayes_filter",
    "bayes_filter_step",
]
