"""Disconnect storm: many concurrent streams, a share of which vanish at random points; nothing may leak.

Each round starts `--streams` streaming chats at once. A `--disconnect` share of them drop their
connection at a random point: before the response arrives, before the first token, or after a
few tokens. Every other stream must complete with exactly `--max-tokens` tokens and a usage
chunk that says so. After each round the server's /metrics must come back to idle: no running or
waiting sequence, and its resident memory (`process_resident_memory_bytes`) less the KV caches that
sessions keep (`h2o_resident_kv_bytes`, bounded by --max-sessions) must not keep growing from round
to round (`--rss-growth-mb`).

    python -m clients.storm --streams 32 --disconnect 0.25 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx

from clients.api import ApiError, ServerUnavailable, make_client, served_model, sse_chunks, wait_ready
from clients.loadbench import format_table

IDLE_GAUGES = ("h2o_running_sequences", "h2o_waiting_sequences")
RSS, KV = "process_resident_memory_bytes", "h2o_resident_kv_bytes"


@dataclass
class Round:
    completed: int = 0
    disconnected: int = 0
    wrong: list[str] = field(default_factory=list)  # survivors that did not end as they should
    settled_s: float = float("nan")  # seconds until /metrics showed no request in flight
    rss_mb: float = float("nan")  # the server's resident memory once idle again
    kv_mb: float = float("nan")  # of which the KV caches that sessions keep (bounded by --max-sessions)

    @property
    def other_mb(self) -> float:
        return self.rss_mb - self.kv_mb


async def one_stream(client: httpx.AsyncClient, model: str, text: str, max_tokens: int, leave_after: int | None) -> str | None:
    """Stream a reply. leave_after: tokens after which to drop the connection (0: before the first;
    -1: before the response headers); None: read to the end. Returns what went wrong, or None."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": text}]}
    request = client.stream("POST", "/v1/chat/completions", json=body)
    if leave_after == -1:
        task = asyncio.create_task(request.__aenter__())
        await asyncio.sleep(0)
        task.cancel()
        return None
    tokens, usage = 0, None
    async with request as response:
        if response.status_code != 200:
            return f"status {response.status_code}: {(await response.aread())[:200]!r}"
        try:
            async with aclosing(sse_chunks(response)) as chunks:  # ends at `data: [DONE]`
                async for chunk in chunks:
                    if leave_after is not None and tokens >= leave_after:
                        return None  # leaving the block closes the connection mid-stream
                    tokens += sum(1 for c in chunk["choices"] if c["delta"].get("content"))
                    usage = chunk.get("usage") or usage
        except (ApiError, httpx.TransportError) as e:
            return f"stream broke: {e!r}"
    if usage is None or usage["completion_tokens"] != max_tokens:
        return f"ended with usage={usage}"
    return None


async def gauges(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (*IDLE_GAUGES, RSS, KV):
            found[name] = float(value)
    return found


async def run_round(url: str, streams: int, disconnect: float, max_tokens: int, rng: random.Random,
                    settle_timeout: float = 60.0) -> Round:
    result = Round()
    async with make_client(url, timeout=120) as client:
        await wait_ready(client, timeout=60)
        model = await served_model(client)
        plans = [None if rng.random() >= disconnect else rng.choice([-1, 0, rng.randint(1, max_tokens - 1)])
                 for _ in range(streams)]
        outcomes = await asyncio.gather(*(
            one_stream(client, model, f"storm {i}: tell me something", max_tokens, plan)
            for i, plan in enumerate(plans)))
        for plan, outcome in zip(plans, outcomes):
            if plan is not None:
                result.disconnected += 1
            elif outcome is None:
                result.completed += 1
            else:
                result.wrong.append(outcome)
        began = time.monotonic()
        while time.monotonic() - began < settle_timeout:
            now = await gauges(client)
            if all(now[name] == 0 for name in IDLE_GAUGES):
                result.settled_s = time.monotonic() - began
                result.rss_mb = now.get(RSS, float("nan")) / 2**20
                result.kv_mb = now.get(KV, float("nan")) / 2**20
                break
            await asyncio.sleep(0.05)
    return result


async def storm(url: str, rounds: int, streams: int, disconnect: float, max_tokens: int, seed: int = 0) -> list[Round]:
    rng = random.Random(seed)
    return [await run_round(url, streams, disconnect, max_tokens, rng) for _ in range(rounds)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams per round")
    p.add_argument("--disconnect", type=float, default=0.25, help="share of streams that vanish")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-growth-mb", type=float, default=100.0,
                   help="most the server's resident memory, less the KV caches sessions keep, may grow "
                        "from the first round to the last")
    args = p.parse_args(argv)
    try:
        rounds = asyncio.run(storm(args.base_url, args.rounds, args.streams, args.disconnect, args.max_tokens, args.seed))
    except (ServerUnavailable, httpx.TransportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [[str(i + 1), str(r.completed), str(r.disconnected), str(len(r.wrong)), f"{r.settled_s:.2f}",
             f"{r.rss_mb:.0f}", f"{r.kv_mb:.0f}"] for i, r in enumerate(rounds)]
    print(format_table(["round", "completed", "disconnected", "wrong", "idle after (s)", "server RSS (MB)",
                        "sessions' KV (MB)"], rows))
    for r in rounds:
        for problem in r.wrong[:3]:
            print(f"  wrong: {problem}")
    ok = all(not r.wrong and r.settled_s == r.settled_s for r in rounds)  # NaN: never settled
    growth = rounds[-1].other_mb - rounds[0].other_mb
    bounded = not growth > args.rss_growth_mb  # NaN (no RSS gauge) passes
    print(f"server RSS growth from round 1 to {len(rounds)}, less the sessions' KV caches: {growth:.0f} MB "
          f"(bound {args.rss_growth_mb:.0f} MB)")
    ok = ok and bounded
    print("ok" if ok else "FAILED: a survivor ended wrongly, the server did not return to idle, or its memory grew")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
