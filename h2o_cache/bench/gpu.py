"""Everything the GPU path promises, measured in one run on the day a GPU is lent; prints one table.

    python -m h2o_cache.bench.gpu --model PATH.gguf   # the model in bf16, the server included
    python -m h2o_cache.bench.gpu --skip-server       # the library only

1. the fast step per bucket (one CUDA graph each), as the server runs it: step, sample, evict;
2. bf16 agreement: greedy tokens of the fast path against the transformers path in bf16 and the
   model in fp32 (`agreement`: where each pair first parts, and the margin there);
3. the server (`python -m server`) with each of `--servers`' flags (default: its defaults, and recall
   off), at 1, 64 and 128 streams of two turns each, driven by `python -m clients.loadbench`:
   processes, so that this library imports neither the server nor the clients;
4. the CUDA tests, `pytest tests/h2o_cache/test_cuda.py`, and the fake-CUDA audit for comparison.

Each stage that fails is a row of the table (its traceback on stderr), and every row is printed as it
comes. Targets on an H100 (issue 26): one stream >= 300 tok/s, 64 streams >= 8k tok/s. Without CUDA
it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from h2o_cache.bench.common import REPO_ROOT, add_model_args, load, markdown_table

NO_CUDA = "python -m h2o_cache.bench.gpu needs a CUDA device and this machine has none (torch.cuda.is_available() is False)"


def tests(path: str, log: Path, timeout: float) -> tuple[str, str]:
    """(passed/failed summary, seconds) of pytest on one file of the repository; its whole output goes to `log`."""
    began = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", path], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=timeout)
        output, ok = run.stdout + run.stderr, run.returncode == 0
    except subprocess.TimeoutExpired as e:
        output, ok = f"{e.stdout or ''}\n{e.stderr or ''}\ntimed out after {timeout:.0f} s", False
    with open(log, "a") as out:
        out.write(f"==== pytest {path}\n{output}\n")
    summary = (output.strip().splitlines() or ["no output"])[-1]
    if not ok:
        print(output[-6000:], file=sys.stderr, flush=True)
    return ("ok: " if ok else "FAILED: ") + summary, f"{time.perf_counter() - began:.0f} s"


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


def agreement(model, tokenizer, config, steps: int, reference) -> list[list[str]]:
    """Greedy tokens of the fast bf16 step against the transformers path in bf16 and an fp32 reference.

    bf16 logits tie often (8 bits of mantissa), so two correct bf16 paths part at some step; what
    matters is whether the fast path parts from the fp32 model sooner than the transformers path does,
    and whether it parts from the latter only at a tie. One row per prompt: the step at which each
    pair first differs ("-": never in `steps`) and the bf16 transformers path's margin there between
    its token and the fast path's, relative to its largest logit (0: an exact tie)."""
    from h2o_cache import Generator, SamplingParams, StaticDecoder
    from h2o_cache.bench.equivalence import first_difference, lockstep

    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in ("What is the boiling point of water?", "Write a haiku about the sea.")]
    prompts = [tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):", *chats]]
    greedy = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    exact = [out.token_ids for out in Generator(reference, tokenizer, config).generate(prompts, greedy)]
    result = lockstep(Generator(model, tokenizer, config), StaticDecoder(model, config, max_rows=len(prompts)),
                      prompts, steps)
    fast, slow, margin = result.fast, result.eager, result.margin
    step = lambda a, b: "-" if first_difference(a, b) is None else str(first_difference(a, b))  # noqa: E731
    return [[f"bf16 agreement, prompt {i}", f"{steps} greedy steps",
             f"fast vs transformers bf16: {step(fast[i], slow[i])}",
             f"fast vs fp32: {step(fast[i], exact[i])}, transformers bf16 vs fp32: {step(slow[i], exact[i])}"
             + ("" if margin[i] is None else f", margin at the split {margin[i]:.2%}")]
            for i in range(len(prompts))]


def sampled(pid: int, out: Path, wait: float = 3.0, seconds: int = 5) -> None:
    """py-spy (if installed) samples process `pid` for `seconds` after `wait`, without stopping it:
    raw stacks into `out`, and the functions the busiest thread spent the most samples in, printed."""
    import shutil
    from collections import Counter

    if shutil.which("py-spy") is None:
        print("py-spy is not installed: no profile", file=sys.stderr, flush=True)
        return
    time.sleep(wait)
    subprocess.run(["py-spy", "record", "-p", str(pid), "-d", str(seconds), "-r", "200", "--nonblocking", "--threads",
                    "-f", "raw", "-o", str(out)], capture_output=True, timeout=seconds + 60)
    if not out.exists():
        return
    threads, functions = Counter(), Counter()
    stacks = [(line.rpartition(" ")[0].split(";"), int(line.rpartition(" ")[2]))
              for line in out.read_text().splitlines() if line.strip()]
    for frames, count in stacks:
        threads[frames[0]] += count
    busiest = threads.most_common(1)[0][0] if threads else ""
    for frames, count in stacks:
        if frames[0] == busiest:
            for name in {frame.split(" (")[0] for frame in frames[1:]}:
                functions[name] += count
    total = sum(threads.values())
    print(f"py-spy, {out.name}: {busiest} in {threads[busiest]} of {total} samples; most inclusive:", flush=True)
    for name, count in functions.most_common(25):
        print(f"  {count:6d}  {name}", flush=True)


def served(flags: str, streams: list[int], turns: int, model: str | None, max_tokens: int, log: Path,
           timeout: float, profile: bool = False) -> list[list[str]]:
    """One `python -m server` with `flags` on top of the defaults, loaded by `clients.loadbench` at each
    count of `streams` in turn, `turns` turns per stream (the first turn pays the cold start, the later
    ones run over the history the first left: evictions, recall). Rows per count and turn: aggregate
    tok/s of the whole run, then per turn the streams' median decode tok/s and time to first token,
    and the mean decode step over the run (the server's /metrics). profile: py-spy samples the server
    for 5 s of its largest count (`sampled`)."""
    import urllib.request
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), "--state-dir", "",
            "--max-batch-size", str(max(streams)), "--max-queue", str(2 * max(streams)), *flags.split()]
    args += ["--model", model] if model else []
    with open(log, "a") as out:
        out.write(f"==== server {flags or '(defaults)'}: {' '.join(args)}\n")
        out.flush()
        server = subprocess.Popen(args, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)

    def steps() -> tuple[float, float]:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                      if line.startswith(("h2o_decode_step_seconds_sum", "h2o_decode_step_seconds_count")))
        return float(values.get("h2o_decode_step_seconds_sum", 0)), float(values.get("h2o_decode_step_seconds_count", 0))

    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in streams:
                summary = Path(tmp) / f"load{n}.json"
                before = steps() if rows else (0.0, 0.0)
                load = subprocess.Popen([sys.executable, "-m", "clients.loadbench", "--base-url", url, "--sessions",
                                         str(n), "--turns", str(turns), "--max-tokens", str(max_tokens), "--ignore-eos",
                                         "--wait", str(int(timeout)), "--quiet", "--json", str(summary)],
                                        cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
                if profile and n == max(streams):
                    sampled(server.pid, Path(f"{log}.{'-'.join(flags.split()) or 'defaults'}.{n}.spy"))
                try:
                    load.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    load.kill()
                    print(f"loadbench at {n} streams timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
                if not summary.exists():
                    rows.append([f"server {flags or '(defaults)'}, {n} streams", "", "no result", ""])
                    continue
                after = steps()
                mean = 1e3 * (after[0] - before[0]) / max(after[1] - before[1], 1)
                result = json.loads(summary.read_text())
                total = result["summary"]
                rows.append([f"server {flags or '(defaults)'}, {n} streams", f"{turns} turns x {max_tokens} tokens",
                             f"{total['aggregate_tps']:.0f} tok/s",
                             f"mean decode step {mean:.1f} ms, errors {total['errors']}"])
                for k in range(1, turns + 1):
                    ts = [t for t in result["turns"] if t["turn"] == k]
                    if ts:
                        rows.append(["", f"turn {k}",
                                     f"per stream p50 {statistics.median(t['decode_tps'] for t in ts):.0f} tok/s",
                                     f"TTFT p50 {1e3 * statistics.median(t['ttft_s'] for t in ts):.0f} ms"])
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--budget", type=int, default=256, help="H2O budget of the step timings and the agreement")
    parser.add_argument("--steps", type=int, default=64, help="timed steps per bucket; greedy steps of the agreement")
    parser.add_argument("--max-rows", type=int, default=128, help="largest bucket of the step timings")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 128], help="concurrent streams on the server")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream and turn on the server")
    parser.add_argument("--turns", type=int, default=2, help="turns per stream on the server")
    parser.add_argument("--servers", nargs="+", action="extend", default=None,
                        help="server flags to compare, one string each ('' = the defaults; default: '' and "
                             "'--recall-budget 0'); a lone flag as --servers=--no-recall-overlap, and the option may "
                             "repeat")
    parser.add_argument("--skip-server", action="store_true", help="measure the library only")
    parser.add_argument("--skip-library", action="store_true", help="leave out the fast step and the agreement")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy (carried in, if absent) samples each server at its largest stream count")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the pytest files (run them apart)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds allowed to each pytest file and each server run")
    parser.add_argument("--log", default="gpu_bench.log", help="the tests' and the servers' whole output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from h2o_cache import CacheConfig

    log = Path(args.log)
    log.write_text("")
    rows: list[list[str]] = []
    began = time.perf_counter()

    def stage(name: str, work) -> None:
        """Run one measurement; a failure is a row of the table (its traceback on stderr), not the end of the run."""
        try:
            for row in work():
                rows.append(row)
                print(" | ".join(row), f"({time.perf_counter() - began:.0f} s)", flush=True)
        except Exception as e:  # one broken stage must not hide the others' results
            traceback.print_exc()
            rows.append([name, "FAILED", f"{type(e).__name__}: {e}"[:200], ""])
            print(f"{name}: FAILED ({time.perf_counter() - began:.0f} s)", flush=True)

    model, tokenizer = load(args)
    config = CacheConfig(policy="h2o", budget=args.budget)
    name = f"{torch.cuda.get_device_name()}, {model.dtype}"
    if not args.skip_library:
        stage("fast step", lambda: ([f"fast step, batch {bucket}", name, f"{ms:.2f} ms", f"{bucket / ms * 1e3:.0f} tok/s"]
                                    for bucket, ms in step_times(model, tokenizer, config, args.max_rows, args.steps)))

        def agree():
            from h2o_cache import load_model

            reference, _ = load_model(args.model, device="cuda", dtype="float32")
            try:
                return agreement(model, tokenizer, config, args.steps, reference)
            finally:
                del reference
                torch.cuda.empty_cache()

        stage("bf16 agreement", agree)
    if not args.skip_server:
        del model
        torch.cuda.empty_cache()
        for flags in args.servers or ["", "--recall-budget 0"]:
            stage(f"server {flags}", lambda flags=flags: served(flags, args.streams, args.turns, args.model,
                                                              args.max_tokens, log, args.timeout, args.profile))
    if not args.skip_tests:
        stage("CUDA tests", lambda: [["CUDA tests", "tests/h2o_cache/test_cuda.py",
                                      *tests("tests/h2o_cache/test_cuda.py", log, args.timeout)]])
        stage("fake-CUDA audit", lambda: [["fake-CUDA audit", "tests/h2o_cache/test_fake_cuda.py",
                                           *tests("tests/h2o_cache/test_fake_cuda.py", log, args.timeout)]])
    print(markdown_table(["what", "setting", "result", ""], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
