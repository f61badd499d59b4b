"""Needle in one long message, through the server: a fact buried in a pasted document, then asked for.

For every cell (document length in words x depth of the needle) and every key, one new conversation
sends a single user message: an instruction, `--words` words of a filler text with a sentence that
states a 5-digit pass key at the given depth, then the question. The reply is generated greedily
(`temperature` 0, `--max-tokens`), as a user would get it, and counts as a hit when it contains the
key. With `--spawn full,h2o` each policy's server is started in turn (extra server flags after
`--server-args`), so the table puts a cache beside the full one on the same questions.

`--form code` asks the way a user pasting a document would, with nothing said up front: news
articles (the XSum documents, a different run of them per key) hold one sentence that states a
6-digit access code once, and the message ends with a question in other words; no instruction says
that something is hidden, and the code is not repeated. `--form name` is the same with a word for an
answer: a sentence in the middle of the news gives a ship's cat's name, and the question asks for it
in other words (a form that none of the cache's settings were tuned on).

    python -m clients.needle --spawn full,h2o --words 700 1400 2800 --keys 10
    python -m clients.needle --spawn full,h2o --form code --words 1500 --depths 0.2 0.5 0.85 --keys 8
    python -m clients.needle --spawn h2o,full --form name --words 1400 2800 --depths 0.25 0.6 0.85 --keys 10
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from clients.server_proc import spawned_server

# the name form's answers: names that the articles do not use
NAMES = ("Mortimer", "Bartholomew", "Clementine", "Archibald", "Penelope", "Ignatius", "Winifred", "Cornelius",
         "Rosalind", "Percival", "Octavia", "Cuthbert", "Marigold", "Thaddeus", "Ottoline", "Barnaby", "Henrietta",
         "Ambrose", "Lavinia", "Reginald")
XSUM = Path(__file__).resolve().parents[2] / "shared/data/xsum_dev.jsonl"


@dataclass(frozen=True)
class Form:
    """A way to hide a fact in one message and ask for it.

    sentence: what is planted, `{key}` standing for the key; question: what the message ends with;
    intro: what it says before the text ("" for nothing up front); step: words between the passages of
    consecutive keys (None: the words' count + 997, and only with --vary: else every key in the first
    words); articles: the filler is the XSum articles (else --text); keys(rng, n): the n keys to find;
    max_tokens: the reply's length (a reply repeats the question's words first); title: for the table."""

    sentence: str
    question: str
    intro: str
    step: int | None
    articles: bool
    keys: Callable[[random.Random, int], list]
    max_tokens: int
    title: str


FORMS = {
    "passkey": Form("The pass key is {key}. Remember it. {key} is the pass key.",
                    "What is the pass key? Answer with the number only.",
                    "There is a pass key hidden in the text below. Find it and remember it.", None, False,
                    lambda rng, n: [rng.randrange(10_000, 100_000) for _ in range(n)], 16, "Pass key"),
    "code": Form("Staff were told that the access code for the north gate is {key}.",
                 "What is the access code for the north gate?", "", 997, True,
                 lambda rng, n: [rng.randrange(100_000, 1_000_000) for _ in range(n)], 24,
                 "A 6-digit code stated once in news articles"),
    "name": Form("The crew's cat, a ginger tom named {key}, had sailed with the ship for nine years.",
                 "What was the name of the cat on the ship?", "", 1013, True,
                 lambda rng, n: rng.sample(NAMES, n), 24, "A name stated once in news articles"),
}


def filler_words(path: Path) -> list[str]:
    """The words of a filler: a JSON-lines file of documents (XSum's `document` field) gives its
    documents' words one after another, any other file its text's."""
    if path.suffix == ".jsonl":
        with path.open() as lines:
            return " ".join(json.loads(line)["document"] for line in lines if line.strip()).split()
    return path.read_text().split()


def planted(words: list[str], start: int, length: int, depth: float, sentence: str) -> str:
    """`length` words of the filler from word `start`, with `sentence` at `depth`."""
    piece = words[start:start + length]
    at = int(depth * length)
    return " ".join(piece[:at] + [sentence] + piece[at:])


def passage_start(words: list[str], length: int, index: int, step: int | None = None) -> int:
    """Where the `index`-th key's passage starts: index x `step` words in (default length + 997, the
    pass-key form's `--vary`), wrapping around the filler."""
    return index * (length + 997 if step is None else step) % max(1, len(words) - length)


def document(form: str, words: list[str], length: int, depth: float, key, index: int = 0, vary: bool = False) -> str:
    """`length` words of the filler with the form's sentence for `key` at `depth`: from the `index`-th
    key's own place (`passage_start`) where the form has a step or `vary`, else from the first word."""
    kind = FORMS[form]
    start = passage_start(words, length, index, kind.step) if kind.step is not None or vary else 0
    return planted(words, start, length, depth, kind.sentence.format(key=key))


def message(form: str, text: str) -> str:
    """The user message: the text and the form's question, after what the form says up front if anything."""
    kind = FORMS[form]
    return f"{kind.intro}\n\n{text}\n\n{kind.question}" if kind.intro else f"{text}\n\n{kind.question}"


def ask(client: httpx.Client, url: str, content: str, max_tokens: int) -> tuple[str, int]:
    response = client.post(f"{url}/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def run(url: str, words: list[str], lengths: list[int], depths: list[float], keys: list[int] | list[str],
        max_tokens: int, form: str = "passkey", vary: bool = False) -> dict[tuple[int, float], tuple[float, int]]:
    """(length, depth) -> (share of keys found, prompt tokens). vary: each pass key in a passage of
    its own (`passage_start`), not all in the filler's first words."""
    out = {}
    with httpx.Client(timeout=600) as client:
        for length in lengths:
            for depth in depths:
                hits, tokens = 0, 0
                for index, key in enumerate(keys):
                    text = document(form, words, length, depth, key, index, vary)
                    reply, tokens = ask(client, url, message(form, text), max_tokens)
                    hits += str(key) in reply
                out[(length, depth)] = (hits / len(keys), tokens)
                print(f"{url} {length} words, depth {depth:.0%}: {hits}/{len(keys)}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--spawn", default=None, help="comma-separated policies to start in turn, e.g. full,h2o")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for spawned servers")
    parser.add_argument("--form", choices=tuple(FORMS), default="passkey",
                        help="passkey: told a key is hidden, the key stated twice; code: a 6-digit code in news "
                             "articles, stated once, nothing said up front; name: the same with a name (of a "
                             f"ship's cat) for an answer, at most {len(NAMES)} keys")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/botchan.txt",
                        help="filler of the passkey form: a text file, or a JSON-lines file of documents (e.g. "
                             "../shared/data/xsum_dev.jsonl, news articles; with --skip-words 0) (the code and name forms "
                             "reads the XSum documents, --xsum)")
    parser.add_argument("--xsum", type=Path, default=XSUM)
    parser.add_argument("--words", type=int, nargs="+", default=[700, 1400, 2800])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="reply length: 16 (passkey), 24 (code and name: the reply repeats the question's words first)")
    parser.add_argument("--skip-words", type=int, default=1500, help="words of the text skipped (a header)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vary", action="store_true",
                        help="passkey form: each key in a passage of its own (the i-th i x (words + 997) words into the "
                             "filler), so a cell averages over texts; default: all in its first words (the code form "
                             "always varies)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    form = FORMS[args.form]
    args.max_tokens = args.max_tokens or form.max_tokens
    if args.form == "name" and not 0 < args.keys <= len(NAMES):
        parser.error(f"--form name has {len(NAMES)} names: --keys 1 to {len(NAMES)}")
    words = filler_words(args.xsum) if form.articles else filler_words(args.text)[args.skip_words:]
    keys = form.keys(rng, args.keys)
    results = {}
    try:
        if args.spawn:
            for policy in args.spawn.split(","):
                began = time.perf_counter()
                with spawned_server(policy, args.server_args, log=Path(f"needle-{policy}.log")) as url:
                    results[policy] = run(url, words, args.words, args.depths, keys, args.max_tokens, args.form, args.vary)
                print(f"{policy}: {time.perf_counter() - began:.0f} s", file=sys.stderr)
        else:
            results[args.base_url] = run(args.base_url, words, args.words, args.depths, keys, args.max_tokens, args.form, args.vary)
    except (httpx.HTTPError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    names = list(results)
    first = results[names[0]]
    print(f"{form.title} in one message, {args.keys} keys per cell, greedy, hit = the key in the reply\n")
    print("| words | prompt tokens | depth | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for cell, (_, tokens) in first.items():
        print(f"| {cell[0]} | {tokens} | {cell[1]:.0%} | " + " | ".join(f"{results[n][cell][0]:.2f}" for n in names) + " |")
    means = [sum(share for share, _ in results[n].values()) / len(first) for n in names]
    print("| mean | | | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
