"""Everything the GPU path promises, measured in one run on the day a GPU is lent; prints one table.

    python -m h2o_cache.bench.gpu                  # the embedded model in bf16, the server included
    python -m h2o_cache.bench.gpu --skip-server    # the library only

1. the CUDA tests: `pytest tests/h2o_cache/test_cuda.py`, and the fake-CUDA audit for comparison;
2. the fast step per bucket (one CUDA graph each), as the server runs it: step, sample, evict;
3. bf16 agreement of the fast path with the transformers path over `--steps` greedy steps
   (`equivalence.lockstep`): tokens equal, and the largest logit gap relative to the largest logit;
4. the server (`python -m server`) at 1, 64 and 128 streams, driven by `python -m clients.loadbench`:
   processes, so that this library imports neither the server nor the clients.

Targets on an H100 (issue 26): one stream >= 300 tok/s, 64 streams >= 8k tok/s. Without CUDA it
says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from h2o_cache.bench.common import REPO_ROOT, add_model_args, load, markdown_table

NO_CUDA = "python -m h2o_cache.bench.gpu needs a CUDA device and this machine has none (torch.cuda.is_available() is False)"


def tests(path: str) -> tuple[str, str]:
    """(passed/failed summary, seconds) of pytest on one file of the repository."""
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", path], cwd=REPO_ROOT, capture_output=True, text=True)
    summary = (run.stdout.strip().splitlines() or ["no output"])[-1]
    return ("ok: " if run.returncode == 0 else "FAILED: ") + summary, f"{time.perf_counter() - began:.0f} s"


def step_times(model, tokenizer, config, max_rows: int, steps: int) -> list[tuple[int, float]]:
    """(bucket, ms per step) of the fast path with every bucket's rows, as the runner runs a step."""
    from h2o_cache import Generator, Sampler, SamplingParams, StaticDecoder, sample

    gen = Generator(model, tokenizer, config)
    decoder = StaticDecoder(model, config, max_rows)
    prompt = torch.randint(3, model.config.vocab_size, (config.budget,), generator=torch.Generator().manual_seed(0))
    row = gen.new_cache(1)
    gen.prefill(row, [prompt.tolist()])
    row.pending = [[5]]
    out = []
    for bucket in decoder.buckets:
        while decoder.cache.batch_size < bucket:
            decoder.cache.extend(row)
        samplers = [Sampler(SamplingParams()) for _ in range(bucket)]
        times = []
        for _ in range(steps + 8):  # the first 8 warm up
            torch.cuda.synchronize()
            began = time.perf_counter()
            drawn = sample(decoder.step(evict=False), samplers)
            decoder.cache.pending = [[d.token] for d in drawn]
            decoder.cache.evict_over_budget()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        out.append((bucket, 1e3 * statistics.median(times[8:])))
    return out


def agreement(model, tokenizer, config, steps: int) -> tuple[str, float]:
    """(rows whose greedy tokens equal the transformers path's, worst relative logit gap)."""
    from h2o_cache import Generator, StaticDecoder
    from h2o_cache.bench.equivalence import lockstep

    gen = Generator(model, tokenizer, config)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):",
                                                   "Once upon a time, in a quiet village,")]
    result = lockstep(gen, StaticDecoder(model, config, max_rows=4), prompts, steps)
    same = sum(fast == eager for fast, eager in zip(result.fast, result.eager))
    return f"{same}/{len(prompts)} rows", max(result.worst)


def served(streams: int, model: str | None, max_tokens: int, log: Path) -> dict:
    """loadbench's summary against a fresh `python -m server` (its --max-batch-size fits the streams)."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--state-dir", "",
            "--max-batch-size", str(max(streams, 1))] + (["--model", model] if model else [])
    with open(log, "a") as out:
        server = subprocess.Popen(args, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = Path(tmp) / "load.json"
            subprocess.run([sys.executable, "-m", "clients.loadbench", "--base-url", f"http://127.0.0.1:{port}",
                            "--sessions", str(streams), "--turns", "1", "--max-tokens", str(max_tokens),
                            "--ignore-eos", "--wait", "600", "--quiet", "--json", str(summary)],
                           cwd=REPO_ROOT, check=False, stdout=subprocess.DEVNULL)
            return json.loads(summary.read_text())["summary"] if summary.exists() else {}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--budget", type=int, default=256, help="H2O budget of the step timings and the agreement")
    parser.add_argument("--steps", type=int, default=64, help="timed steps per bucket; greedy steps of the agreement")
    parser.add_argument("--max-rows", type=int, default=128, help="largest bucket of the step timings")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 128], help="concurrent streams on the server")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream on the server")
    parser.add_argument("--skip-server", action="store_true", help="measure the library only")
    parser.add_argument("--log", default="gpu_bench.log", help="the servers' output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from h2o_cache import CacheConfig

    rows = [["CUDA tests", "tests/h2o_cache/test_cuda.py", *tests("tests/h2o_cache/test_cuda.py")],
            ["fake-CUDA audit", "tests/h2o_cache/test_fake_cuda.py", *tests("tests/h2o_cache/test_fake_cuda.py")]]
    model, tokenizer = load(args)
    config = CacheConfig(policy="h2o", budget=args.budget)
    name = f"{torch.cuda.get_device_name()}, {model.dtype}"
    for bucket, ms in step_times(model, tokenizer, config, args.max_rows, args.steps):
        rows.append([f"fast step, batch {bucket}", name, f"{ms:.2f} ms", f"{bucket / ms * 1e3:.0f} tok/s"])
    same, worst = agreement(model, tokenizer, config, args.steps)
    rows.append(["bf16 fast vs transformers path", f"{args.steps} greedy steps", f"{same} equal",
                 f"worst logit gap {worst:.2%}"])
    if not args.skip_server:
        del model
        torch.cuda.empty_cache()
        log = Path(args.log)
        log.write_text("")
        for streams in args.streams:
            s = served(streams, args.model, args.max_tokens, log)
            rows.append([f"server, {streams} streams", f"{args.max_tokens} tokens each",
                         f"{s.get('aggregate_tps', float('nan')):.0f} tok/s",
                         f"per stream p50 {s.get('stream_tps_p50', float('nan')):.0f} tok/s, errors {s.get('errors', '?')}"])
    print(markdown_table(["what", "setting", "result", ""], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
