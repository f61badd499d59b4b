"""What a larger `--kv-budget` costs and buys, servers side by side on the same long messages.

Every message is a pasted document with one fact said once (`clients.needle`'s forms: by default
`code`, a 6-digit access code in news articles, asked for in other words), sent as a new conversation
to every server in turn, the servers' order rotated from message to message so that a drifting machine
times them alike. Each reply is streamed and `--max-tokens` long (`min_tokens` holds the end of turn
back), greedy. Per server the table gives:

- the device memory one conversation holds (the server's `h2o_resident_kv_bytes` over its
  `h2o_active_sessions`, read from /metrics after each reply) and the host memory of its archive of
  evicted tokens (`h2o_archived_kv_bytes`, the same way);
- the facts found: the key anywhere in the reply;
- time to first token and decode milliseconds a token (after the first), medians over the messages,
  and each as a ratio to the first server's at the same message (the median of those ratios).

    python -m clients.budget_bench --spawn defaults= --spawn 512="--kv-budget 512" \\
        --spawn 1024="--kv-budget 1024" --spawn full="--policy full" --server-args --threads 2
    python -m clients.budget_bench --base-url a=http://127.0.0.1:8011 --base-url b=http://127.0.0.1:8012

Each spawned server also gets `--state-dir ''` (no conversation is kept across runs) and logs to
`budget-<label>.log`. The servers answer one at a time: only one of them is busy at any moment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx

from clients.api import ApiError, ServerUnavailable, make_client, stream_chat, wait_ready
from clients.loadbench import fixed_length
from clients.needle import CITIES, FORMS, NAMES, XSUM, document, filler_words, holds, message
from clients.server_proc import ServerFailed, start_server, stop_server

GAUGES = ("h2o_resident_kv_bytes", "h2o_archived_kv_bytes", "h2o_active_sessions")
SKIP_WORDS = 1500  # the passkey form's text: words skipped (a header), as clients.needle does


def labelled(spec: str, what: str) -> tuple[str, str]:
    """'LABEL=VALUE' -> (LABEL, VALUE); the label must not be empty (the value may be)."""
    label, sep, value = spec.partition("=")
    if not sep or not label:
        raise ValueError(f"{what} {spec!r}: expected LABEL=VALUE")
    return label, value


def gauges(text: str) -> dict[str, float]:
    """The unlabelled GAUGES of a Prometheus text page (absent ones left out)."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)\s+([-+0-9.eE]+|NaN)\s*$", line)
        if match and match.group(1) in GAUGES:
            found[match.group(1)] = float(match.group(2))
    return found


def per_conversation(page: dict[str, float]) -> tuple[float | None, float | None]:
    """Device and archive bytes a conversation holds, averaged over the sessions the server keeps (None
    where the server does not report them)."""
    sessions = page.get("h2o_active_sessions")
    if not sessions:
        return None, None
    return tuple(page[name] / sessions if name in page else None for name in GAUGES[:2])


def messages(form: str, words: list[str], count: int, length: int, depths: list[float], seed: int) -> list[tuple[str, str]]:
    """`count` (user message, answer) pairs: the form's fact at depths cycling through `depths`, each message
    from its own place of the filler."""
    kind = FORMS[form]
    keys = kind.keys(random.Random(seed), count)
    return [(message(form, document(form, words, length, depths[i % len(depths)], key, i, vary=True), key=key),
             kind.answer(key)) for i, key in enumerate(keys)]


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return {}
    return gauges(response.text) if response.status_code == 200 else {}


async def play(urls: dict[str, str], sent: list[tuple[str, str]], max_tokens: int, quiet: bool = False,
               api_key: str | None = None) -> list[dict]:
    """Every message to every server, as a new conversation, the servers' order rotated by one a message;
    one row per (message, server)."""
    labels = list(urls)
    clients = {label: make_client(url, api_key) for label, url in urls.items()}
    rows = []
    try:
        for label, client in clients.items():
            await wait_ready(client)
        for i, (content, key) in enumerate(sent):
            for label in labels[i % len(labels):] + labels[:i % len(labels)]:
                turn = await stream_chat(clients[label], [{"role": "user", "content": content}], max_tokens=max_tokens,
                                         extra=fixed_length(max_tokens))
                device, archive = per_conversation(await metrics(clients[label]))
                row = {"server": label, "message": i, "prompt_tokens": turn.usage.get("prompt_tokens"),
                       "completion_tokens": turn.completion_tokens, "ttft_s": turn.ttft,
                       "decode_ms": 1e3 / turn.decode_tps if turn.decode_tps else None, "found": holds(key, turn.text),
                       "device_bytes": device, "archive_bytes": archive, "reply": turn.text}
                rows.append(row)
                if not quiet:
                    print(f"{label} message {i}: {row['prompt_tokens']} prompt tokens, first token {turn.ttft:.2f} s, "
                          f"{row['decode_ms'] or float('nan'):.2f} ms a token, {'found' if row['found'] else 'missed'}",
                          file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return rows


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None, digits: int, scale: float = 1.0) -> str:
    return "" if value is None else f"{value / scale:.{digits}f}"


def table(rows: list[dict], labels: list[str]) -> list[str]:
    """The markdown table: each server's memory, facts found and medians, with ratios to labels[0] paired
    by message."""
    by = {label: {row["message"]: row for row in rows if row["server"] == label} for label in labels}
    reference = by[labels[0]]
    lines = [f"| server | prompt tokens | device MB a conversation | archive MB | found | first token, s | "
             f"x {labels[0]} | decode, ms a token | x {labels[0]} |", "|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        mine = by[label]
        paired = [(mine[m], reference[m]) for m in mine if m in reference]
        ttft = _median(a["ttft_s"] / b["ttft_s"] for a, b in paired if b["ttft_s"])
        decode = _median(a["decode_ms"] / b["decode_ms"] for a, b in paired if a["decode_ms"] and b["decode_ms"])
        prompts = [row["prompt_tokens"] for row in mine.values() if row["prompt_tokens"]]
        lines.append(
            f"| {label} | {f'{min(prompts)}-{max(prompts)}' if prompts else ''} | "
            f"{_cell(_median(r['device_bytes'] for r in mine.values()), 1, 1e6)} | "
            f"{_cell(_median(r['archive_bytes'] for r in mine.values()), 1, 1e6)} | "
            f"{sum(r['found'] for r in mine.values())}/{len(mine)} | {_cell(_median(r['ttft_s'] for r in mine.values()), 2)} | "
            f"{_cell(ttft, 2)} | {_cell(_median(r['decode_ms'] for r in mine.values()), 2)} | {_cell(decode, 2)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawn", action="append", default=[], metavar="LABEL=FLAGS",
                        help="a server to start with these flags (shell words; empty: the defaults); repeatable")
    parser.add_argument("--base-url", action="append", default=[], metavar="LABEL=URL",
                        help="a running server to measure; repeatable (after the spawned ones)")
    parser.add_argument("--api-key", default=None, help="sent to every server (a spawned one needs --server-args "
                        "--api-key too)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="flags for every spawned server (last on the command line)")
    parser.add_argument("--form", choices=tuple(FORMS), default="code",
                        help="what each message plants (clients.needle's forms)")
    parser.add_argument("--xsum", type=Path, default=XSUM, help="news articles: the code and name forms' filler")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/botchan.txt",
                        help="the passkey form's filler")
    parser.add_argument("--words", type=int, default=3000, help="words of each document (3000: ~4k tokens)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--messages", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64, help="every reply's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every row (replies included) here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        spawns = [labelled(spec, "--spawn") for spec in args.spawn]
        running = [labelled(spec, "--base-url") for spec in args.base_url]
    except ValueError as error:
        parser.error(str(error))
    labels = [label for label, _ in spawns + running]
    if not labels or len(set(labels)) != len(labels):
        parser.error("name at least one server (--spawn or --base-url), each label once")
    if args.messages < 1 or args.words < 1 or args.max_tokens < 2 or not all(0 <= d <= 1 for d in args.depths):
        parser.error("--messages >= 1, --words >= 1, --max-tokens >= 2 (a decode time), depths within 0-1")
    if args.form == "name" and args.messages > len(NAMES):
        parser.error(f"--form name has {len(NAMES)} names: --messages 1 to {len(NAMES)}")
    if args.form == "place" and args.messages > len(CITIES):
        parser.error(f"--form place has {len(CITIES)} cities: --messages 1 to {len(CITIES)}")
    form = FORMS[args.form]
    try:
        words = filler_words(args.xsum) if form.articles else filler_words(args.text)[SKIP_WORDS:]
    except OSError as error:
        parser.error(f"the filler: {error}")
    sent = messages(args.form, words, args.messages, args.words, args.depths, args.seed)
    with ExitStack() as stack:
        urls = {}
        try:
            for label, flags in spawns:
                proc, url = start_server(["--state-dir", "", *shlex.split(flags), *args.server_args],
                                         Path(f"budget-{label}.log"))
                stack.callback(stop_server, proc)
                urls[label] = url
            urls.update(running)
            rows = asyncio.run(play(urls, sent, args.max_tokens, args.quiet, args.api_key))
        except (ServerFailed, OSError, httpx.HTTPError, ApiError, ServerUnavailable) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"{form.title}: {args.messages} messages of {args.words} words, each to every server in rotated order, "
          f"replies of {args.max_tokens} tokens, greedy; medians over the messages, ratios paired by message\n")
    print("\n".join(table(rows, labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
