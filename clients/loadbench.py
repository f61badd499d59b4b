"""Concurrent multi-turn conversations against a running server; prints latency and throughput.

    python -m clients.loadbench --sessions 8 --turns 4 --max-tokens 64
    python -m clients.loadbench --base-url http://127.0.0.1:8080 --history session --duration 120 --json out/load.json

Each session is one conversation of --turns user turns (MT-Bench questions), all sessions at once.
The client is a single asyncio task set over one httpx pool, so it sleeps on sockets and leaves the
CPU to the server. --duration stops new turns (in-flight ones finish). Exit status 1 if any turn failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from clients.api import (
    DEFAULT_URL,
    ApiError,
    Conversation,
    ServerUnavailable,
    Turn,
    make_client,
    served_model,
    wait_ready,
)
from clients.questions import QuestionsNotFound, mtbench_turns

FALLBACK_PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
                    "Write a letter to a friend about your garden.", "Describe the water cycle in detail."]


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no data."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


@dataclass
class LoadResult:
    sessions: int
    wall_s: float = 0.0
    turns: list[tuple[int, int, Turn]] = field(default_factory=list)  # (session, turn index, turn)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        ts = [t for _, _, t in self.turns]
        gaps = [g for t in ts for g in t.inter_token_gaps]
        tokens = sum(t.completion_tokens for t in ts)
        return {"sessions": self.sessions, "turns_ok": len(ts), "errors": len(self.errors), "tokens": tokens,
                "wall_s": self.wall_s, "ttft_p50_s": percentile([t.ttft for t in ts], 50),
                "ttft_p95_s": percentile([t.ttft for t in ts], 95), "itl_p50_s": percentile(gaps, 50),
                "itl_p95_s": percentile(gaps, 95), "stream_tps_p50": percentile([t.decode_tps for t in ts], 50),
                "aggregate_tps": tokens / self.wall_s if self.wall_s else 0.0}


def default_prompts() -> list[str]:
    try:
        return [t["text"] for t in mtbench_turns()]
    except QuestionsNotFound:
        return FALLBACK_PROMPTS


def fixed_length(max_tokens: int) -> dict:
    """Body fields for a reply of exactly max_tokens: `ignore_eos`, and `min_tokens` at max_tokens, which
    holds the end of turn back instead of sampling past it, so that the reply stays text its
    conversation continues from (after an `ignore_eos` reply ran past its end, this server prefills the
    whole conversation again at the next turn); a server without `min_tokens` still has `ignore_eos`."""
    return {"ignore_eos": True, "min_tokens": max_tokens}


async def run_load(base_url: str, *, sessions: int, turns: int, max_tokens: int, duration: float = 3600.0,
                   history: str = "session", prompts: list[str] | None = None, api_key: str | None = None,
                   model: str | None = None, wait: float = 0.0, progress: bool = False,
                   ignore_eos: bool = False) -> LoadResult:
    """Run `sessions` conversations at once, each up to `turns` turns; a failed conversation stops."""
    prompts = prompts or default_prompts()
    result = LoadResult(sessions)
    async with make_client(base_url, api_key) as client:
        await wait_ready(client, wait)
        model = model or await served_model(client)
        bar = tqdm(total=sessions * turns, unit="turn", disable=not progress, file=sys.stderr, leave=False)
        t0 = time.perf_counter()

        async def session(i: int) -> None:
            conv = Conversation(resend=history == "resend")
            for k in range(turns):
                if time.perf_counter() - t0 > duration:
                    return
                try:
                    turn = await conv.ask(client, prompts[(i * turns + k) % len(prompts)], model=model,
                                          max_tokens=max_tokens, temperature=0.0,
                                          extra=fixed_length(max_tokens) if ignore_eos else None)
                except (ApiError, ServerUnavailable) as e:
                    result.errors.append(f"session {i} turn {k + 1}: {e}")
                    return
                finally:
                    bar.update()
                result.turns.append((i, k + 1, turn))

        await asyncio.gather(*(session(i) for i in range(sessions)))
        result.wall_s = time.perf_counter() - t0
        bar.close()
    return result


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def summary_table(s: dict) -> str:
    rows = [["sessions x turns ok", f"{s['sessions']} x {s['turns_ok'] / max(s['sessions'], 1):.1f}"],
            ["TTFT p50 / p95", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p95_s'])}"],
            ["inter-token latency p50 / p95", f"{ms(s['itl_p50_s'])} / {ms(s['itl_p95_s'])}"],
            ["per-stream decode tok/s (p50)", f"{s['stream_tps_p50']:.1f}"],
            ["aggregate generated tok/s", f"{s['aggregate_tps']:.1f} ({s['tokens']} tokens in {s['wall_s']:.1f} s)"],
            ["errors", str(s["errors"])]]
    return format_table(["measure", "value"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_URL)
    p.add_argument("--sessions", type=int, default=4, help="conversations running at once")
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=64, help="reply length limit per turn")
    p.add_argument("--duration", type=float, default=600.0, help="seconds after which no new turn starts")
    p.add_argument("--history", choices=["session", "resend"], default="session",
                   help="session: new message + X-Session-ID; resend: whole history each turn")
    p.add_argument("--ignore-eos", action="store_true", help="every reply is exactly --max-tokens long (the server extras ignore_eos and min_tokens, "
                        "so that a conversation's next turn still continues its session)")
    p.add_argument("--api-key")
    p.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for /health")
    p.add_argument("--json", help="write the summary and every turn's timings here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        result = asyncio.run(run_load(args.base_url, sessions=args.sessions, turns=args.turns,
                                      max_tokens=args.max_tokens, duration=args.duration, history=args.history,
                                      api_key=args.api_key, model=args.model, wait=args.wait, ignore_eos=args.ignore_eos,
                                      progress=not args.quiet and args.sessions * args.turns >= 20))
    except ServerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = result.summary()
    print(summary_table(summary))
    for err in result.errors[:5]:
        print(f"error: {err}", file=sys.stderr)
    if args.json:
        turns = [{"session": i, "turn": k, "ttft_s": t.ttft, "decode_tps": t.decode_tps, "turn_s": t.t_end - t.t_start,
                  "completion_tokens": t.completion_tokens, "usage": t.usage} for i, k, t in result.turns]
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "summary": summary, "errors": result.errors, "turns": turns}, f, indent=1)
    return 1 if result.errors or not result.turns else 0


if __name__ == "__main__":
    sys.exit(main())
