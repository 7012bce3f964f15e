"""Triton kernels for the GPU path, below both the model and the runtime: each fuses what plain
torch would run as several kernels. Importing a module here needs triton."""
