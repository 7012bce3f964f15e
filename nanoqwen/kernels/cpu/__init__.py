"""C kernels for the CPU, compiled at first use (build.py) and called through ctypes."""
