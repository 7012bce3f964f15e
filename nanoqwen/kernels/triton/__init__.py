"""Triton kernels for the GPU path; their tests also run them in Triton's CPU interpreter."""
