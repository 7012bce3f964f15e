"""Column layout of the sampler's per-slot parameter tables, shared by the Triton kernels and
the torch code that fills and reads the tables (importable without triton)."""

# fparams: float32 [slots, NUM_F]
F_TEMPERATURE = 0  # 1 for greedy rows, so their processed logits are the penalised logits
F_TOP_P = 1
F_MIN_P = 2
F_REPETITION = 3
F_PRESENCE = 4
F_FREQUENCY = 5
NUM_F = 6
# iparams: int64 [slots, NUM_I]
I_TOP_K = 0  # the vocabulary size when off
I_MIN_TOKENS = 1
I_SEED = 2
I_FLAGS = 3
NUM_I = 4
# Bits of the flags column.
FLAG_GREEDY = 1
FLAG_PENALTY = 2
FLAG_BAN = 4  # min_tokens > 0: EOS and stop tokens banned until that many outputs
