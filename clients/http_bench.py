"""What one server process's HTTP side sustains: the real app on a `StubEngine`, no model.

    python -m clients.http_bench --streams 1 64 128 --tokens 400 --step-ms 5

For each variant (`--variants`: a uvicorn http/loop stack, `auto/auto` being what the server picks,
`h11/asyncio` what a plain `pip install uvicorn` gives, `httptools/uvloop` what `uvicorn[standard]`
gives; `+switch=MS` sets the server's GIL switch interval) it starts a server on a stub engine (`python -m server.stub_serve`) that emits a
token to every running stream each `--step-ms` (a fast GPU step), streams `--tokens` tokens to each
of N concurrent raw-socket clients, and prints the tokens/s delivered and the server's CPU time per
token, with each variant's ratio to the first, all measured in one run. The load generator runs in
this process (uvloop when installed, reading whole socket buffers), so it costs far less than the
server it measures; on a 2-core machine the two still share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import importlib.util
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from clients.server_proc import start_server, stop_server

TOKEN = b" t"  # the stub's tokens are " t0", " t1", ...; nothing else in its SSE frames has a space


async def stream(port: int, tokens: int) -> tuple[int, bool]:
    """One streamed reply of `tokens` tokens; returns (tokens read, whether it ended with [DONE])."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "stub", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "go"}]}).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    await reader.readuntil(b"\r\n\r\n")  # the response's headers
    count, tail, end = 0, b"", b""
    while data := await reader.read(1 << 16):  # to EOF: the server closes after the reply
        count += (tail + data).count(TOKEN)  # a token may straddle two reads
        tail, end = data[-1:], (end + data)[-64:]
    writer.close()
    return count, b"data: [DONE]" in end


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int, streams: int, tokens: int) -> tuple[float, int, int]:
    """(wall seconds, tokens delivered, streams that ended with [DONE])."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(port, tokens) for _ in range(streams)))
    wall = time.perf_counter() - start
    return wall, sum(count for count, _ in results), sum(done for _, done in results)


def measure(variant: str, streams: list[int], tokens: int, step_ms: float, log: str) -> dict[int, dict]:
    stack, *options = variant.split("+")
    http, loop = stack.split("/")
    extra = [arg for option in options if option.startswith("switch=") for arg in ("--switch-ms", option.removeprefix("switch="))]
    proc, url = start_server(["--http", http, "--loop", loop, "--step-ms", str(step_ms), *extra], Path(log),
                             ready_timeout=60, module="server.stub_serve")
    port = urlsplit(url).port
    try:
        asyncio.run(load(port, 4, 20))  # warm-up: imports, first connections
        out = {}
        for n in streams:
            cpu = cpu_seconds(proc.pid)
            client = time.process_time()
            wall, delivered, done = asyncio.run(load(port, n, tokens))
            server_cpu = cpu_seconds(proc.pid) - cpu
            out[n] = {"tok_s": delivered / wall, "server_us_per_token": 1e6 * server_cpu / max(delivered, 1),
                      "client_us_per_token": 1e6 * (time.process_time() - client) / max(delivered, 1),
                      "complete": done == n and delivered == n * tokens, "offered_tok_s": n * 1000 / step_ms}
        return out
    finally:
        stop_server(proc)


def default_variants() -> list[str]:
    installed = all(importlib.util.find_spec(name) for name in ("httptools", "uvloop"))
    return ["h11/asyncio"] + (["httptools/uvloop"] if installed else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--tokens", type=int, default=400, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stub engine's step time")
    parser.add_argument("--variants", default=",".join(default_variants()),
                        help="comma-separated http/loop[+switch=MS] variants; the first is the reference "
                             "(default: h11/asyncio, and httptools/uvloop when both are installed)")
    parser.add_argument("--log", default="http_bench.log", help="the stub servers' output")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    results = {v: measure(v, args.streams, args.tokens, args.step_ms, args.log) for v in variants}
    ref = variants[0]
    print(f"stub engine: one token per stream every {args.step_ms:g} ms, {args.tokens} tokens per stream")
    header = f"{'variant':<26} {'streams':>7} {'offered tok/s':>13} {'tok/s':>9} {'x ' + ref:>16} " \
             f"{'server us/token':>15} {'client us/token':>15}  complete"
    print(header)
    print("-" * len(header))
    for variant in variants:
        for n, r in results[variant].items():
            ratio = r["tok_s"] / results[ref][n]["tok_s"]
            print(f"{variant:<26} {n:>7} {r['offered_tok_s']:>13.0f} {r['tok_s']:>9.0f} {ratio:>15.2f}x "
                  f"{r['server_us_per_token']:>15.1f} {r['client_us_per_token']:>15.1f}  {r['complete']}")
    return 0 if all(r["complete"] for res in results.values() for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
