"""Benchmarks of linmem beside its peers, measured in one run (DESIGN.md section 8)."""
