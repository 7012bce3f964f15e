"""Kernels by device: Triton for the GPU (triton/), C for the CPU (cpu/, with its build and
ctypes wrappers), and the op set a decoder layer runs on each (layer_ops.py)."""
