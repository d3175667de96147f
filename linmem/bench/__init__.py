"""Benchmarks of linmem beside its peers, measured in one run (the protocols in each module, the tables in
BENCHMARKS.md)."""


class BenchError(ValueError):
    """A benchmark that cannot run here as asked (e.g. a CUDA benchmark on a machine without CUDA):
    ``linmem bench`` prints it as one ``linmem: error:`` line and exits with status 2."""
