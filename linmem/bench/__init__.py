"""Benchmarks of linmem beside its peers, measured in one run (the protocols in each module, the tables in
BENCHMARKS.md)."""
