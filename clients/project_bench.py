"""The project benchmark: one table of ratios, all measured in one run, on the CPU default model.

1. Continuous batching: aggregate generated tokens/s with 1, 2, 4, 8 and 16 concurrent streams,
   as a ratio to one stream (target: 8 streams >= 4x one stream).
2. Constant cost per turn: a 30-turn MT-Bench conversation that re-sends its whole history every
   turn (the OpenAI client path); time per generated token of the last turn over the first, per policy.

    python -m clients.project_bench --spawn h2o,full --out out/bench
    python -m clients.project_bench --spawn h2o,h2o+eager       # the fast decode step vs --enforce-eager
    python -m clients.project_bench --base-url h2o=http://127.0.0.1:8000      # a server already running

--spawn starts each policy's server in turn on a free loopback port (never two at once, so they
do not share the cores), waits for /health and stops it afterwards; POLICY+eager adds --enforce-eager.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from contextlib import nullcontext
from pathlib import Path

from tqdm import tqdm

from clients.api import ApiError, Conversation, ServerUnavailable, make_client, served_model
from clients.loadbench import fixed_length, format_table, run_load
from clients.questions import QuestionsNotFound, mtbench_turns
from clients.server_proc import ServerFailed, spawned_server


async def conversation_cost(url: str, turns: list[str], max_tokens: int) -> dict:
    """Play `turns` into one re-sent-history conversation; per turn: whole-turn seconds per token. Every
    reply is max_tokens long (`fixed_length`), so the turns compare equal work."""
    rows = []
    async with make_client(url) as client:
        model = await served_model(client)
        conv = Conversation(resend=True)
        for text in tqdm(turns, unit="turn", file=sys.stderr, leave=False):
            try:
                t = await conv.ask(client, text, model=model, max_tokens=max_tokens, temperature=0.0,
                                   extra=fixed_length(max_tokens))
            except ApiError as e:
                return {"turns": rows, "error": f"turn {len(rows) + 1}: {e}"}
            rows.append({"s_per_token": t.seconds_per_token, "completion_tokens": t.completion_tokens,
                         "ttft_s": t.ttft, "conversation_tokens": t.usage.get("conversation_tokens"),
                         "kv_resident_tokens": t.usage.get("kv_resident_tokens"),
                         "cached_tokens": (t.usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    return {"turns": rows, "error": None}


async def measure(url: str, args, prompts: list[str]) -> dict:
    await run_load(url, sessions=1, turns=1, max_tokens=8, prompts=prompts)  # warm-up: first forward passes
    sweep = {}
    for n in args.streams:
        r = await run_load(url, sessions=n, turns=args.rounds, max_tokens=args.max_tokens, prompts=prompts[n:],
                           ignore_eos=True, progress=True)
        sweep[n] = r.summary()
        first_error = f" (first: {r.errors[0]})" if r.errors else ""
        print(f"  {n:2d} streams: {sweep[n]['aggregate_tps']:.1f} tok/s, {len(r.errors)} errors{first_error}", flush=True)
    conv = await conversation_cost(url, prompts[: args.conversation_turns], args.max_tokens)
    print(f"  {len(conv['turns'])}-turn conversation done{': ' + conv['error'] if conv['error'] else ''}", flush=True)
    return {"sweep": sweep, "conversation": conv}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report(results: dict[str, dict], args) -> str:
    """One table: a column per policy, a row per measure, ratios measured in this run."""
    def row(name: str, cell, target: str = "") -> list[str]:
        return [name, *[cell(r["sweep"], r["conversation"]["turns"]) for r in results.values()], target]

    def turn_ms(turns: list[dict], i: int) -> str:
        done = len(turns) == args.conversation_turns if i else bool(turns)
        return f"{turns[i]['s_per_token'] * 1000:.1f}" if done else "failed"

    base, last = args.streams[0], args.conversation_turns
    rows = [row(f"aggregate tok/s, {n} stream{'s' * (n > 1)}", lambda sw, _, n=n: f"{sw[n]['aggregate_tps']:.1f}")
            for n in args.streams]
    rows += [row(f"{n} streams / {base} stream",
                 lambda sw, _, n=n: ratio(sw[n]["aggregate_tps"], sw[base]["aggregate_tps"]),
                 ">= 4x" if (n, base) == (8, 1) else "") for n in args.streams[1:]]
    rows += [row("turn 1 ms/token (whole turn)", lambda _, t: turn_ms(t, 0)),
             row(f"turn {last} ms/token", lambda _, t: turn_ms(t, -1)),
             row(f"turn {last} / turn 1", lambda _, t: ratio(t[-1]["s_per_token"], t[0]["s_per_token"])
                 if len(t) == last else "failed", "h2o ~1x"),
             row("conversation tokens at the end", lambda _, t: str(t[-1]["conversation_tokens"]) if t else "-"),
             row("resident KV tokens at the end", lambda _, t: str(t[-1]["kv_resident_tokens"]) if t else "-")]
    errors = [f"{p}: {r['conversation']['error']}" for p, r in results.items() if r["conversation"]["error"]]
    return "\n".join([format_table(["measure", *results, "target"], rows), *errors])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--spawn", help="comma-separated policies to start servers for, e.g. h2o,full; "
                                            "POLICY+eager runs that policy with --enforce-eager")
    where.add_argument("--base-url", action="append", help="LABEL=URL of a running server, repeatable")
    p.add_argument("--server-args", default="", help="extra `python -m server` flags for --spawn, e.g. '--kv-budget 256'")
    p.add_argument("--streams", default="1,2,4,8,16", help="concurrency levels; the first is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="turns each stream runs at every level")
    p.add_argument("--max-tokens", type=int, default=64, help="reply length limit per turn")
    p.add_argument("--conversation-turns", type=int, default=30)
    p.add_argument("--out", default="out/bench", help="directory for server logs and results.json")
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        prompts = [t["text"] for t in mtbench_turns()]
    except QuestionsNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    targets = ([(pol, None) for pol in args.spawn.split(",")] if args.spawn
               else [tuple(b.split("=", 1)) for b in args.base_url])
    results = {}
    try:
        for label, url in targets:
            print(f"{label}: {'starting a server' if url is None else url}", flush=True)
            policy, eager = label.removesuffix("+eager"), label.endswith("+eager")
            flags = shlex.split(args.server_args) + (["--enforce-eager"] if eager else [])
            server = (spawned_server(policy, flags, out / f"server-{label}.log")
                      if url is None else nullcontext(url))
            with server as base_url:
                results[label] = asyncio.run(measure(base_url, args, prompts))
    except (ServerFailed, ServerUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report(results, args))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = any(r["conversation"]["error"] or any(s["errors"] for s in r["sweep"].values()) for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
