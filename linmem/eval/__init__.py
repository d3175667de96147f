"""Evaluation: synthetic recall tasks (MQAR) and their metrics."""

from .mqar import MQAR_GRID, MQAR_VOCAB_SIZE, generate_mqar, mqar_accuracy, mqar_hits, shift_labels_right

__all__ = ["MQAR_GRID", "MQAR_VOCAB_SIZE", "generate_mqar", "mqar_accuracy", "mqar_hits", "shift_labels_right"]
