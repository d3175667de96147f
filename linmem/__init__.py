"""linmem: memory layers of sequence models under one unified linear recurrence."""

__version__ = "0.1.0"
