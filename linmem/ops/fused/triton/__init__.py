"""Triton kernels of the fused ops, each beside its launcher. Imported on first use (see ``..backend``)."""
