"""ModelRunner.prompt_logits: teacher-forced logits of a whole sequence in one prefill."""

from __future__ import annotations

import torch

from nanoqwen import LLM, SamplingParams


def test_prompt_logits_match_hf_forward_and_leave_the_pool_free(tiny_model):
    path, hf = tiny_model
    llm = LLM(str(path), block_size=16, num_kv_blocks=32, progress=False)
    ids = [(7 * i + 3) % 400 for i in range(50)]
    ours = llm.runner.prompt_logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (50, hf.config.vocab_size)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(llm.runner.prompt_logits(ids, last=5), ours[-5:])
    assert llm.scheduler.blocks.num_free_blocks == 32
    # The last row is what greedy generation picks next.
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert out[0].token_ids == [int(ours[-1].argmax())]
