"""The real GGUF read by nanoqwen: block codes, config and tokenizer.

- Each quantized block type in the file (Q8_0, Q5_0, Q6_K, Q4_K) read into the canonical
  format dequantizes to exactly what gguf-py's reference dequantizer gives.
- The config, EOS ids, chat template and tokenizer nanoqwen reads from the file equal those
  of the checkpoint directory tools/make_qwen_coder.py built from it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanoqwen.model.config import ModelConfig
from nanoqwen.model.load_gguf import open_gguf
from nanoqwen.quant.format import dequantize
from nanoqwen.quant.gguf_blocks import EXACT_TYPES, from_gguf_blocks
from nanoqwen.weights.gguf import GGUFCheckpoint
from nanoqwen.weights.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model


def test_every_quantized_block_type_decodes_exactly(gguf_path):
    seen = {}
    for t in GGUFCheckpoint(gguf_path).tensors():
        if t.type_name in EXACT_TYPES and t.type_name not in seen:
            rows = t.data[:48]  # a few rows of each: the layout repeats per row
            ours = dequantize(from_gguf_blocks(t.type_name, rows))
            ref = gguf_dequantize(np.asarray(rows), GGMLQuantizationType[t.type_name])
            seen[t.type_name] = torch.equal(ours, torch.from_numpy(ref.reshape(ours.shape)))
    # Q5_K, not in this file, is checked on random blocks (tests/quant/test_gguf_packed.py).
    assert seen == dict.fromkeys(("Q8_0", "Q5_0", "Q6_K", "Q4_K"), True)


def test_metadata_matches_the_converted_checkpoint(gguf_path, real_model_dir):
    _, cfg, tokenizer = open_gguf(str(gguf_path))
    assert cfg == ModelConfig.from_file(real_model_dir / "config.json")
    built = Tokenizer(real_model_dir)
    assert tokenizer.eos_token_ids == built.eos_token_ids == {151643, 151645}
    assert tokenizer.chat_template == built.chat_template
    messages = [{"role": "user", "content": "def f(x):\n\treturn x ** 2  # ünïcode 你好 🙂"}]
    assert tokenizer.encode_chat(messages) == built.encode_chat(messages)
    text = "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><tool_call><|endoftext|>  x\r\n"
    assert tokenizer.encode(text) == built.encode(text)
