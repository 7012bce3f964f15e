"""Tensor parallelism: process groups, worker processes, and the per-step message that
carries rank 0's scheduling decisions to the other ranks."""
