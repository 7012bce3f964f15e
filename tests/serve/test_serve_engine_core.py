"""The engine process's loop (EngineCore.serve) over real pipes, in a thread: it finishes its
work while nobody reads its output, and what it sends joins to LLM.generate's tokens."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest

from nanoqwen import LLM, SamplingParams
from nanoqwen.serve.batch_sender import BatchSender, receive
from nanoqwen.serve.engine_core import EngineCore
from nanoqwen.serve.messages import AddRequest, Shutdown


@pytest.mark.parametrize("tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
def test_engine_steps_on_while_nobody_reads_its_output(tiny_model, tokenizer):
    llm = LLM(str(tiny_model[0]), block_size=16, num_kv_blocks=256, progress=False)
    if not tokenizer:
        llm.tokenizer = None  # as with random weights: tokens only, no text
    greedy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompts = [[5 + i, 17, 42 + i] for i in range(16)]
    want = [out.token_ids for out in llm.generate(prompts, greedy)]
    in_recv, in_send = Pipe(duplex=False)
    out_recv, out_send = Pipe(duplex=False)
    core = EngineCore(llm)
    loop = threading.Thread(target=core.serve, args=(in_recv, out_send), daemon=True)
    loop.start()
    requests = BatchSender(in_send, "test-input")
    requests.put_all([AddRequest(i, p, greedy) for i, p in enumerate(prompts)])
    # ~200 steps of 16 rows: far more than the pipe's 64 kB buffer holds unread.
    deadline = time.monotonic() + 120
    while core.steps < 200 or core.has_work:
        assert time.monotonic() < deadline, f"the engine stalled after {core.steps} steps"
        time.sleep(0.05)
    blocks = llm.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # all finished, none read yet
    requests.put(Shutdown())
    tokens: dict[int, list[int]] = {i: [] for i in range(16)}
    texts = dict.fromkeys(range(16), "")
    finished = set()
    while len(finished) < 16:
        for out in receive(out_recv):
            for request_id, token, text in zip(
                out.request_ids, out.token_ids, out.texts, strict=True
            ):
                tokens[request_id].append(token)
                texts[request_id] += text
            for request_id, text, token_ids, done, reason, _logprobs, _extras in out.rows:
                tokens[request_id] += token_ids
                texts[request_id] += text
                if done:
                    assert reason == "length"
                    finished.add(request_id)
    assert [tokens[i] for i in range(16)] == want
    want_texts = [llm.tokenizer.decode(ids) if tokenizer else "" for ids in want]
    assert [texts[i] for i in range(16)] == want_texts
    loop.join(10)
    assert not loop.is_alive()
    requests.close()
