"""The paged KV cache: the device pool's tensors (cache.py) and their size (sizing.py), the
blocks (block_pool.py) and each sequence's block table over them (block_manager.py), and the
pinned host pool that swapped-out and evicted blocks go to (host_pool.py)."""
