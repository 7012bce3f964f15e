"""CPU cost of the serving path, measured in CPU seconds (not wall-clock, which a shared
machine makes noisy): what the HTTP process and the engine process spend on a burst of
streaming requests, against what LLM.generate spends on the same requests offline.

    python tools/serve_cpu_profile.py server --model DIR [--num-requests 256]
        # `nanoqwen serve` in a subprocess; a burst from one client process; the CPU
        # seconds of the HTTP process and the engine process (/proc), per request and per
        # streamed token. --output-len 1:1 isolates the per-request (intake) cost.
        # --profile FILE: the HTTP process under cProfile (pstats file).
    python tools/serve_cpu_profile.py engine --model DIR
        # in this process, one thread: LLM.generate, then EngineCore.serve over pipes on the
        # same requests (everything the engine process does beyond generate: taking requests
        # in, take_output, pickling); --profile FILE: the EngineCore run under cProfile.

--model is a checkpoint directory (the tests' tiny model, or weights/...). The workload is the
serving benchmark's (nanoqwen.bench.serve.make_workload), token-id prompts with ignore_eos."""

from __future__ import annotations

import argparse
import cProfile
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from multiprocessing import Pipe, get_context
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoqwen.bench.serve import Workload, make_workload  # noqa: E402

ENGINE_FLAGS = ["--device", "cpu", "--block-size", "16", "--num-kv-blocks", "4096"]


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of pid so far (clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out.append(int(stat.parent.name))
    return out


# The server under cProfile; SIGUSR1 writes the profile (uvicorn ends on SIGTERM by raising the
# signal again, so nothing written at exit would survive).
PROFILED_SERVER = """
import cProfile, signal, sys
from nanoqwen.cli import main
profiler, path = cProfile.Profile(), sys.argv[1]
def dump(signum, frame):
    profiler.disable()
    profiler.dump_stats(path)
signal.signal(signal.SIGUSR1, dump)
profiler.enable()
main(sys.argv[2:])
"""


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str, int]:
    python = [sys.executable, "-m", "nanoqwen"]
    if args.profile:
        python = [sys.executable, "-c", PROFILED_SERVER, args.profile]
    cmd = [*python, "serve", "--port", "0", "--model", args.model,
           *ENGINE_FLAGS, "--log-level", "warning", *args.server_args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": args.server_repo or str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"serving .* on (http://[\d.]+:\d+)", log.read_text(errors="replace"))
        if found:
            break
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        time.sleep(0.2)
    else:
        raise SystemExit("the server did not start")
    (engine,) = [p for p in children(proc.pid) if b"spawn_main" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    return proc, found.group(1), engine


def run_server(args: argparse.Namespace, work: Workload) -> None:
    import httpx

    from nanoqwen.bench.serve_client import send_requests

    log = Path(args.log)
    proc, url, engine = start_server(args, log)
    try:
        bodies = [
            {"prompt": p, "max_tokens": n, "temperature": 0.6, "ignore_eos": True,
             "stream": True, "return_token_ids": True}
            for p, n in zip(work.prompts, work.output_lens)
        ]  # fmt: skip
        httpx.post(f"{url}/v1/completions", json={**bodies[0], "stream": False}, timeout=600)
        for _ in range(args.repeats):
            http0, engine0 = cpu_seconds(proc.pid), cpu_seconds(engine)
            results, duration = send_requests(
                f"{url}/v1/completions", None, bodies, [0.0] * len(bodies), 1
            )
            time.sleep(0.5)  # the last events written, the engine idle again
            http_s, engine_s = cpu_seconds(proc.pid) - http0, cpu_seconds(engine) - engine0
            failed = [r.error for r in results if not r.ok]
            tokens = sum(r.output_tokens for r in results)
            chunks = sum(len(r.itl) + 1 for r in results if r.ok)
            n = len(results)
            print(
                f"{n} requests, {tokens} tokens in {chunks} chunks, {duration:.2f} s wall, "
                f"{len(failed)} failed {failed[:1]}\n"
                f"  HTTP process   {http_s:7.3f} CPU s = {http_s / n * 1e6:8.0f} us/request"
                f" = {http_s / tokens * 1e6:6.1f} us/token\n"
                f"  engine process {engine_s:7.3f} CPU s = {engine_s / n * 1e6:8.0f} us/request"
                f" = {engine_s / tokens * 1e6:6.1f} us/token",
                flush=True,
            )
    finally:
        if args.profile:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
        proc.terminate()
        proc.wait(60)


def read_outputs(outputs, inputs, num_requests: int) -> None:
    """Reads what EngineCore sends until every request finished, then tells it to stop."""
    from nanoqwen.serve.batch_sender import receive
    from nanoqwen.serve.messages import Shutdown

    finished = 0
    while finished < num_requests:
        for out in receive(outputs):
            finished += sum(row[3] for row in out.rows)
    inputs.send_bytes(pickle.dumps([Shutdown()]))


def run_engine(args: argparse.Namespace, work: Workload) -> None:
    import torch

    from nanoqwen import LLM, SamplingParams
    from nanoqwen.serve.batch_sender import BatchSender
    from nanoqwen.serve.engine_core import EngineCore
    from nanoqwen.serve.messages import AddRequest

    torch.set_num_threads(1)  # all the work in this thread: thread_time sees it
    llm = LLM(args.model, device="cpu", block_size=16, num_kv_blocks=4096, progress=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
              for n in work.output_lens]  # fmt: skip
    if args.no_tokenizer:
        llm.tokenizer = None  # as with random weights: no text, no detokenizing
    llm.generate(work.prompts[:2], SamplingParams(max_tokens=2))
    # CPU spent inside LLM.step / drain is the same work either way; what is left over is the
    # loop's own: generate's bookkeeping, or EngineCore's intake, outputs and pickling.
    inside = [0.0]
    for name in ("step", "drain", "add_request"):
        inner = getattr(llm, name)

        def timed(*a, _inner=inner, **k):
            t0 = time.thread_time()
            try:
                return _inner(*a, **k)
            finally:
                inside[0] += time.thread_time() - t0

        setattr(llm, name, timed)
    for _ in range(args.repeats):
        inside[0] = 0.0
        start = time.thread_time()
        outputs = llm.generate(work.prompts, params)
        offline, offline_inside = time.thread_time() - start, inside[0]
        tokens = sum(len(o.token_ids) for o in outputs)

        in_recv, in_send = Pipe(duplex=False)
        out_recv, out_send = Pipe(duplex=False)
        core = EngineCore(llm)
        requests = BatchSender(in_send, "profile-input")
        requests.put_all([AddRequest(i, p, sp) for i, (p, sp) in
                          enumerate(zip(work.prompts, params))])  # fmt: skip
        # The reader in a process of its own, as the HTTP process is: not on this GIL.
        reader = get_context("spawn").Process(
            target=read_outputs, args=(out_recv, in_send, len(work.prompts)), daemon=True
        )
        reader.start()
        profiler = cProfile.Profile() if args.profile else None
        inside[0] = 0.0
        start = time.thread_time()
        if profiler is not None:
            profiler.enable()
        core.serve(in_recv, out_send)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        online, online_inside = time.thread_time() - start, inside[0]
        reader.join()
        requests.close()
        out_recv.close()
        steps = core.steps
        loop_offline, loop_online = offline - offline_inside, online - online_inside
        print(
            f"{len(work.prompts)} requests, {tokens} tokens, {steps} steps: CPU s in step "
            f"{offline_inside:.3f} (generate) / {online_inside:.3f} (EngineCore); around it "
            f"generate {loop_offline * 1e6 / steps:.0f} us/step, EngineCore "
            f"{loop_online * 1e6 / steps:.0f} us/step = {loop_online * 1e6 / tokens:.2f} us/token",
            flush=True,
        )


def stub_engine(inputs, outputs, step_s: float) -> None:
    """An engine process that computes nothing: each running request gets one token a step,
    a step every step_s seconds, so the HTTP side's costs stand alone."""
    from nanoqwen.serve.batch_sender import BatchSender, receive
    from nanoqwen.serve.messages import AddRequest, EngineStats, Shutdown, StepOutputs

    sender = BatchSender(outputs, "stub-engine")
    live: dict[int, int] = {}  # request id -> tokens left
    added = 0
    while True:
        if not live:
            inputs.poll(None)
        out = StepOutputs()
        while inputs.poll(0):
            for item in receive(inputs):
                if isinstance(item, Shutdown):
                    sender.close()
                    return
                if isinstance(item, AddRequest):
                    live[item.request_id] = item.params.max_tokens
                    added += 1
        for request_id, left in list(live.items()):
            if left == 1:
                out.rows.append((request_id, "", [1], True, "length", None))
                del live[request_id]
            else:
                if hasattr(out, "request_ids"):
                    out.request_ids.append(request_id)
                    out.token_ids.append(left)
                    out.texts.append("")
                else:  # a checkout from before the token columns (a baseline)
                    out.rows.append((request_id, "", [left], False, None, None))
                live[request_id] = left - 1
        out.stats = EngineStats(len(live), 0, 100, 100, 0, added)
        sender.put(out)
        time.sleep(step_s)


async def asgi_burst(app, bodies: list[bytes]) -> int:
    """Sends the bodies to the app's /v1/completions at once, as uvicorn would; returns the
    number of SSE events received."""
    import asyncio

    events = 0

    async def one(body: bytes) -> None:
        nonlocal events
        sent = False
        done = asyncio.Event()

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            nonlocal events
            if message["type"] == "http.response.body":
                events += message.get("body", b"").count(b"data: ")
                if not message.get("more_body", False):
                    done.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        await app(scope, receive, send)

    await asyncio.gather(*(one(b) for b in bodies))
    return events


def run_asgi(args: argparse.Namespace, work: Workload) -> None:
    import asyncio
    import json
    import multiprocessing

    from nanoqwen.serve.app import ServerConfig, build_app
    from nanoqwen.serve.engine_client import EngineClient
    from nanoqwen.serve.model_info import ModelInfo

    ctx = multiprocessing.get_context("spawn")
    in_recv, in_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    stub = ctx.Process(
        target=stub_engine, args=(in_recv, out_send, args.step_ms / 1e3), daemon=True
    )
    stub.start()
    in_recv.close()
    out_send.close()
    engine = EngineClient(in_send, out_recv, stub)
    app = build_app(engine, ModelInfo(None, 4096, 151936), ServerConfig("m"))
    bodies = [
        json.dumps({"prompt": p, "max_tokens": n, "temperature": 0.6, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}).encode()
        for p, n in zip(work.prompts, work.output_lens)
    ]  # fmt: skip

    async def main() -> None:
        async with app.router.lifespan_context(app):
            await asgi_burst(app, bodies[:8])  # warm-up
            for _ in range(args.repeats):
                profiler = cProfile.Profile() if args.profile else None
                start = time.process_time()
                if profiler is not None:
                    profiler.enable()
                events = await asgi_burst(app, bodies)
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(args.profile)
                cpu = time.process_time() - start
                tokens = sum(work.output_lens)
                n = len(bodies)
                print(
                    f"{n} requests, {tokens} tokens, {events} events: {cpu:.3f} CPU s = "
                    f"{cpu / n * 1e6:.0f} us/request, {cpu / tokens * 1e6:.1f} us/token",
                    flush=True,
                )

    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["server", "engine", "asgi"])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=_span, default=(100, 1024), help="LOW:HIGH tokens")
    p.add_argument("--output-len", type=_span, default=(16, 64), help="LOW:HIGH tokens")
    p.add_argument("--max-token-id", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-tokenizer", action="store_true",
                   help="engine: drop the tokenizer (random weights have none)")  # fmt: skip
    p.add_argument("--profile", help="write a cProfile (pstats) file")
    p.add_argument("--step-ms", type=float, default=0.0, help="asgi: the stub engine's step time")
    p.add_argument("--server-repo", help="server: run the server from this checkout (a baseline)")
    p.add_argument("--log", default="/tmp/serve_cpu_profile.log", help="the server's log")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `nanoqwen serve` flags (last)")  # fmt: skip
    args = p.parse_args()
    work = make_workload(args.num_requests, args.prompt_len, args.output_len, args.max_token_id)
    {"server": run_server, "engine": run_engine, "asgi": run_asgi}[args.what](args, work)


if __name__ == "__main__":
    main()
