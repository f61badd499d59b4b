"""Needle in one long message, through the server: a fact buried in a pasted document, then asked for.

For every cell (document length in words x depth of the needle) and every key, one new conversation
sends a single user message: an instruction, `--words` words of a filler text with a sentence that
states a 5-digit pass key at the given depth, then the question. The reply is generated greedily
(`temperature` 0, `--max-tokens`), as a user would get it, and counts as a hit when it contains the
key. With `--spawn full,h2o` each policy's server is started in turn (extra server flags after
`--server-args`), so the table puts a cache beside the full one on the same questions.

    python -m clients.needle --spawn full,h2o --words 700 1400 2800 --keys 10
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import httpx

from clients.server_proc import spawned_server

QUESTION = "What is the pass key? Answer with the number only."


def document(words: list[str], length: int, depth: float, key: int) -> str:
    at = int(depth * length)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return " ".join(words[:at] + [needle] + words[at:length])


def ask(client: httpx.Client, url: str, text: str, max_tokens: int) -> tuple[str, int]:
    content = f"There is a pass key hidden in the text below. Find it and remember it.\n\n{text}\n\n{QUESTION}"
    response = client.post(f"{url}/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def run(url: str, words: list[str], lengths: list[int], depths: list[float], keys: list[int],
        max_tokens: int) -> dict[tuple[int, float], tuple[float, int]]:
    """(length, depth) -> (share of keys found, prompt tokens)."""
    out = {}
    with httpx.Client(timeout=600) as client:
        for length in lengths:
            for depth in depths:
                hits, tokens = 0, 0
                for key in keys:
                    reply, tokens = ask(client, url, document(words, length, depth, key), max_tokens)
                    hits += str(key) in reply
                out[(length, depth)] = (hits / len(keys), tokens)
                print(f"{url} {length} words, depth {depth:.0%}: {hits}/{len(keys)}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--spawn", default=None, help="comma-separated policies to start in turn, e.g. full,h2o")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for spawned servers")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/botchan.txt")
    parser.add_argument("--words", type=int, nargs="+", default=[700, 1400, 2800])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--skip-words", type=int, default=1500, help="words of the text skipped (a header)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    words = args.text.read_text().split()[args.skip_words:]
    rng = random.Random(args.seed)
    keys = [rng.randrange(10_000, 100_000) for _ in range(args.keys)]
    results = {}
    try:
        if args.spawn:
            for policy in args.spawn.split(","):
                began = time.perf_counter()
                with spawned_server(policy, args.server_args, log=Path(f"needle-{policy}.log")) as url:
                    results[policy] = run(url, words, args.words, args.depths, keys, args.max_tokens)
                print(f"{policy}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
        else:
            results[args.base_url] = run(args.base_url, words, args.words, args.depths, keys, args.max_tokens)
    except (httpx.HTTPError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    names = list(results)
    first = results[names[0]]
    print(f"Pass key in one message, {args.keys} keys per cell, greedy, hit = the key in the reply\n")
    print("| words | prompt tokens | depth | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for cell, (_, tokens) in first.items():
        print(f"| {cell[0]} | {tokens} | {cell[1]:.0%} | " + " | ".join(f"{results[n][cell][0]:.2f}" for n in names) + " |")
    means = [sum(share for share, _ in results[n].values()) / len(first) for n in names]
    print("| mean | | | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
