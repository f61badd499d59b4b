"""Pass-key and fact retrieval through budgeted caches, vs budget, filler length and depth.

A 5-digit pass key (or, with `--fact`, a one-sentence fact: a secret city) is planted at a depth of
0-90% of a filler (`botchan.txt`, a novel, or with `--text` another file; a JSON-lines file of
documents such as `xsum_dev.jsonl` gives news articles), and the chat then asks for it. The answer is teacher-forced
after a fixed opening ("The pass key is ", its space included), and a key counts as recalled when
greedy decoding would produce every one of its tokens there; this equals greedy generation after
that opening and costs one pass per answer token. The opening is fed one token per pass, as a
server decodes its reply (a recalling cache's decode passes choose their windows pooled over all
layers); `--opening prefill` feeds it as one chunk instead, which no server reply does. All keys of one cell run as rows of one batch.
By default they share one passage (the filler's first tokens, prefilled once), so a cell measures one
place of one text ten or twenty times; `--vary` gives each key a passage of its own (with news
articles, other articles), so a cell averages over texts as a user's documents would.

`--facts N` plants N secrets of different kinds (a pass key, a secret city, a secret animal, a
secret fruit) at N depths of one prompt, evenly spaced, and asks for them in turn, one per user turn,
each answer fed (teacher-forced) before the next question: cell "fact k" scores the k-th question over
every set, all of whose secrets sit in the same pasted document.

`--list N` plants N secrets the same way and asks for all of them in one answer, in the order of
the document (aggregation over N places of the prompt): the answer's words between the values ("The
pass key is", ", the secret city is", ...) are fed as a template, and a set counts only when every
token of every value is reproduced.

`--chat N ...` asks the way the product is used instead: turn 1 tells the key, then N turns each
paste ~350 words of the filler and ask for a one-line summary (the assistant's replies are a fixed
short acknowledgement, teacher-forced, to keep the runs cheap), and the last turn asks for the key.
The conversation goes through the cache turn by turn, as the server feeds it: each user turn is a
prefill that may recall (`Generator.prefill(recall=True)`), each reply is fed after it.
A conversation longer than the model's window is reported as n/a for `full`, which cannot follow it.

Caches: `policy:budget`, with `+rN` for a recall budget of N tokens (`h2o:256+r128`); `full` has
no budget. A one-prompt cell is fed as one user turn too: with recall, its last tokens (the question)
probe what the prompt's beginning evicted, as the server does. Prompts are fed in chunks of
budget // 2 with recall (as the server feeds them), budget // 4 without (as in the other benches), 512
for full.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path


from h2o_cache import CacheConfig, Generator, reread
from h2o_cache.bench.common import add_model_args, config_field, data_path, load, markdown_table, read_text
from h2o_cache.bench.nll import FULL_CHUNK, Item, fork, score

CITIES = [
    "Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Dublin", "Quito", "Seoul", "Tunis", "Vienna",
    "Manila", "Dakar", "Havana", "Riga", "Perth", "Cairo", "Bogota", "Zurich", "Accra", "Kyoto",
]
FILLER_START = 2000  # tokens of botchan.txt skipped: the Project Gutenberg header is not story text


def filler_text(path: Path) -> tuple[str, int]:
    """The filler's text and how many of its tokens to skip: a JSON-lines file of documents (XSum's
    `document` field: news articles, a filler unlike the novel) gives them one after another, none
    skipped; a plain text file its text past the header (`FILLER_START`)."""
    return read_text(path), 0 if path.suffix == ".jsonl" else FILLER_START


@dataclass(frozen=True)
class Secret:
    """What is planted and how it is asked for."""

    kind: str  # what the intro says is hidden: SmolLM2-135M finds a "pass key" only when told one is
    needle: str  # the sentence planted in the filler
    question: str
    opening: str  # the teacher-forced start of the answer
    answer: str  # what must follow the opening, with its leading space


def secrets(n: int, fact: bool, seed: int = 0) -> list[Secret]:
    rng = random.Random(seed)
    if fact:
        return [Secret("secret city", f" The secret city is {city}. Remember the secret city: {city}. ",
                       "What is the secret city?", "The secret city is", f" {city}")
                for city in rng.sample(CITIES, n)]
    keys = [rng.randrange(10_000, 100_000) for _ in range(n)]
    return [Secret("pass key", f" The pass key is {key}. Remember it. {key} is the pass key. ",
                   "What is the pass key?", "The pass key is", f" {key}") for key in keys]


def answer_tokens(gen: Generator, secret: Secret) -> tuple[list[int], list[int]]:
    """(opening tokens, answer tokens) such that their concatenation tokenizes opening + answer."""
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    opening, whole = encode(secret.opening), encode(secret.opening + secret.answer)
    if whole[:len(opening)] != opening:
        raise ValueError(f"{secret.opening!r} tokenizes differently before {secret.answer!r}")
    answer = whole[len(opening):]
    if len(answer) > 1 and not gen.tokenizer.decode(answer[:1]).strip():
        # A lone space before the digits is forced too: SmolLM2-135M often goes on in prose there
        # ("The pass key is a small wooden box") even when it knows the digits; asked is the key.
        return whole[:len(opening) + 1], answer[1:]
    return opening, answer


def passages(filler: list[int], length: int, count: int) -> list[list[int]]:
    """`count` stretches of `length` filler tokens, the i-th starting i x (length + 1009) tokens in
    (wrapping around the filler), so that the keys of a cell sit in different passages (with news
    articles: different articles) rather than all in the first `length` tokens."""
    room = max(1, len(filler) - length)
    return [filler[start:start + length] for start in (i * (length + 1009) % room for i in range(count))]


def varied_prompts(gen: Generator, filler: list[int], length: int, planted: list[Secret],
                   depth: float) -> tuple[list[int], list[Chat]]:
    """`single_prompt` for each secret in a passage of its own (`passages`): the shared prefix is the
    instruction alone, and each chat feeds its passage's text before the needle first."""
    instruction, chats = [], []
    for passage, secret in zip(passages(filler, length, len(planted)), planted):
        prefix, chat = single_prompt(gen, passage, secret, depth)
        at = len(prefix) - int(depth * len(passage))  # where the passage starts, after the instruction
        instruction = prefix[:at]
        chats.append(Chat(([(prefix[at:], False)] if prefix[at:] else []) + chat.pieces, chat.item))
    return instruction, chats


def single_prompt(gen: Generator, filler: list[int], secret: Secret, depth: float) -> tuple[list[int], Chat]:
    """One user message: instruction, the filler with the needle at `depth`, the question.

    Returns the tokens before the needle, which do not depend on the secret (all keys of a cell
    share them, so they are prefilled once), and the rest: the user turn's remaining tokens (fed as
    a turn, so a cache that recalls probes with its last tokens), then the answer to score.
    """
    marker = "\x00"
    rendered = gen.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"There is a {secret.kind} hidden in the text below. Find it and remember it.\n\n"
                                     f"{marker}\n\n{secret.question}"}],
        tokenize=False, add_generation_prompt=True)
    before, after = rendered.split(marker)
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    at = int(depth * len(filler))
    opening, answer = answer_tokens(gen, secret)
    return encode(before) + filler[:at], Chat([(encode(secret.needle) + filler[at:] + encode(after), True)], Item(opening, answer))


@dataclass(frozen=True)
class Chat:
    """A conversation as the cache is fed it: (tokens, is a user turn) pieces, then the answer to score.

    User turns end with the assistant's header (the generation prompt), replies run to the next
    turn; the opening of the final answer is the `Item`'s context, the key its target.
    """

    pieces: list[tuple[list[int], bool]]
    item: Item

    @property
    def tokens(self) -> int:
        return sum(len(p) for p, _ in self.pieces) + len(self.item.context)


def chat_prompt(gen: Generator, words: list[str], secret: Secret, turns: int, words_per_turn: int = 350) -> Chat:
    """Turn 1 tells the secret, `turns` filler turns follow, the last turn asks for it."""
    ack = "Noted."
    messages = [{"role": "user", "content": f"Please remember this.{secret.needle.rstrip()}"},
                {"role": "assistant", "content": "OK, I will remember it."}]
    for turn in range(turns):
        passage = " ".join(words[turn * words_per_turn:(turn + 1) * words_per_turn])
        messages += [{"role": "user", "content": f"Here is a passage:\n\n{passage}\n\nSummarize it in one line."},
                     {"role": "assistant", "content": ack}]
    messages.append({"role": "user", "content": f"{secret.question} I told you at the start."})
    encode = lambda upto, ask: gen.tokenizer.encode(  # noqa: E731
        gen.tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=ask),
        add_special_tokens=False)
    pieces, fed = [], []
    for upto in range(1, len(messages) + 1):
        ask = messages[upto - 1]["role"] == "user"
        tokens = encode(upto, ask)
        if tokens[:len(fed)] != fed:
            raise ValueError("the chat template renders a turn differently once the conversation goes on")
        pieces.append((tokens[len(fed):], ask))
        fed = tokens
    opening, answer = answer_tokens(gen, secret)
    return Chat(pieces, Item(opening, answer))


# The kinds of secret `--facts` and `--list` plant, each asked for by its own name: keys told apart
# by labels ("the pass key of the red door") the full cache itself answered 1 time in 10 on
# SmolLM2-135M, so a several-facts score measured the model, not the cache.
ANIMALS = ["otter", "falcon", "badger", "walrus", "heron", "bison", "gecko", "panda", "moose", "beaver"]
FRUITS = ["mango", "plum", "lemon", "cherry", "peach", "melon", "apricot", "guava", "lime", "banana"]
KINDS = ("pass key", "secret city", "secret animal", "secret fruit")


def kind_values(facts: int, seed: int) -> dict[str, str]:
    """One value per kind of the first `facts` kinds."""
    rng = random.Random(seed)
    draw = {"pass key": lambda: str(rng.randrange(10_000, 100_000)), "secret city": lambda: rng.choice(CITIES),
            "secret animal": lambda: rng.choice(ANIMALS), "secret fruit": lambda: rng.choice(FRUITS)}
    return {kind: draw[kind]() for kind in KINDS[:facts]}


def told(kinds: list[str], article: str = "a") -> str:
    """"a pass key, a secret city and a secret animal"."""
    named = [f"{article} {kind}" for kind in kinds]
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + f" and {named[-1]}"


def segments(gen: Generator, parts: list[tuple[str, bool]]) -> tuple[list[int], tuple[bool, ...]]:
    """The tokens of the parts' text joined, and per token whether it belongs to an asked part (a
    value) and is not whitespace alone; the text must tokenize part by part (as it does at spaces)."""
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    tokens, asked, text = [], [], ""
    for part, ask in parts:
        text += part
        now = encode(text)
        if now[:len(tokens)] != tokens:
            raise ValueError(f"{text!r} tokenizes differently once {part!r} follows")
        new = now[len(tokens):]
        asked += [ask and bool(gen.tokenizer.decode([t]).strip()) for t in new]
        tokens = now
    return tokens, tuple(asked)


def secrets_document(gen: Generator, filler: list[int], values: dict[str, str]) -> tuple[list[int], int]:
    """The filler with one needle per kind at depths (i + 0.5) / len(values), in `values` order, and
    where the first needle starts."""
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    document, at = [], 0
    for i, (kind, value) in enumerate(values.items()):
        depth = int((i + 0.5) / len(values) * len(filler))
        document += filler[at:depth] + encode(f" The {kind} is {value}. Remember it. {value} is the {kind}. ")
        at = depth
    return document + filler[at:], int(0.5 / len(values) * len(filler))


def answer_item(gen: Generator, parts: list[tuple[str, bool]]) -> Item:
    """An answer made of fed words and asked values: the context runs to the first asked token, the
    target is the rest (its fed words are teacher-forced, only the asked tokens count)."""
    tokens, asked = segments(gen, parts)
    first = asked.index(True)
    return Item(tokens[:first], tokens[first:], asked=asked[first:])


def facts_prompts(gen: Generator, filler: list[int], facts: int, seed: int) -> tuple[list[int], list[Chat]]:
    """`facts` secrets of different kinds (a pass key, a secret city, ...) at depths (i + 0.5) / facts
    of one document, asked for in turn.

    Returns the tokens before the first needle (shared by every question of this set) and one Chat per
    question: the rest of the document turn (whose question is the first), then for each earlier
    question its answer as the assistant's reply and the next question as a user turn.
    """
    values = kind_values(facts, seed)
    asked = random.Random(seed + 1).sample(list(values), facts)
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    marker = "\x00"
    intro = f"There are {facts} secrets hidden in the text below: {told(list(values))}. Find them and remember them.\n\n{marker}\n\n"
    messages = [{"role": "user", "content": intro + f"What is the {asked[0]}?"}]
    for before, kind in zip(asked, asked[1:]):
        messages += [{"role": "assistant", "content": f"The {before} is {values[before]}."},
                     {"role": "user", "content": f"What is the {kind}?"}]
    render = lambda upto, ask: gen.tokenizer.apply_chat_template(  # noqa: E731
        messages[:upto], tokenize=False, add_generation_prompt=ask)
    head, tail = render(1, True).split(marker)
    document, first_needle = secrets_document(gen, filler, values)
    prefix = encode(head) + document[:first_needle]
    turns = [(document[first_needle:] + encode(tail), True)]
    chats, rendered = [], render(1, True)
    for k, kind in enumerate(asked):
        if k:
            reply_text, question_text = render(2 * k, False), render(2 * k + 1, True)
            turns = turns + [(encode(reply_text[len(rendered):]), False), (encode(question_text[len(reply_text):]), True)]
            rendered = question_text
        chats.append(Chat(list(turns), answer_item(gen, [(f"The {kind} is", False), (f" {values[kind]}", True)])))
    return prefix, chats


def listing_prompt(gen: Generator, filler: list[int], facts: int, seed: int) -> tuple[list[int], Chat]:
    """Aggregation: `facts` secrets of different kinds at depths (i + 0.5) / facts of one document, and
    one question whose answer names them all in the order of the document ("The pass key is 12345, the
    secret city is Oslo and the secret animal is otter."): every needle must be found for the answer to
    count; its words between the values are fed."""
    values = kind_values(facts, seed)
    encode = lambda text: gen.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    marker = "\x00"
    kinds = list(values)
    content = (f"There are {facts} secrets hidden in the text below: {told(kinds)}. Find them and remember them."
               f"\n\n{marker}\n\nWhat are {told(kinds, 'the')}?")
    head, tail = gen.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True).split(marker)
    parts = []
    for i, kind in enumerate(kinds):
        joint = "" if i == 0 else (" and the" if i == len(kinds) - 1 else ", the")
        parts += [(f"{joint} {kind} is" if i else f"The {kind} is", False), (f" {values[kind]}", True)]
    item = answer_item(gen, parts + [(".", False)])
    document, first_needle = secrets_document(gen, filler, values)
    turn = document[first_needle:] + encode(tail)
    return encode(head) + document[:first_needle], Chat([(turn, True)], item)


def cache_config(spec: str, settings: dict[str, str] | None = None) -> CacheConfig:
    """`full`, `policy:budget` or `policy:budget+rN` (recall budget N); `settings` (FIELD: VALUE, from
    `--set`) override CacheConfig fields of an evicting cache, each parsed as the field's default is."""
    policy, _, budget = spec.partition(":")
    if policy == "full":
        return CacheConfig(policy="full", prefill_chunk=FULL_CHUNK)
    budget, _, recall = budget.partition("+r")
    chunk = int(budget) // (2 if recall else 4)  # the server's chunk with recall
    config = CacheConfig(policy=policy, budget=int(budget), prefill_chunk=max(1, chunk), recall_budget=int(recall or 0))
    return replace(config, **{name: config_field(name, value) for name, value in (settings or {}).items()})


def recalled(gen: Generator, config: CacheConfig, prefix: list[int], chats: list[Chat], batch: int,
             decode_opening: bool = True) -> int:
    """How many chats, each continuing the common `prefix`, have answers greedy decoding reproduces.
    Chats are fed piece by piece first, user turns with recall; then the answer's opening, one token
    per pass as a reply is decoded (`decode_opening`), else as one chunk."""
    total = 0
    for start in range(0, len(chats), batch):
        group = chats[start:start + batch]
        cache = fork(gen, config, prefix, len(group))
        for i in range(len(group[0].pieces)):  # the first piece goes on with the prefix's turn
            gen.prefill(cache, [chat.pieces[i][0] for chat in group], recall=group[0].pieces[i][1],
                        before=[prefix] * len(group) if i == 0 else None)
        group = [chat.item for chat in group]
        if decode_opening:
            group = decode_openings(gen, cache, group)
        _, hits = score(gen, config, group, cache)
        total += sum(int(h) == item.needed for h, item in zip(hits.tolist(), group))
    return total


def decode_openings(gen: Generator, cache, items: list[Item]) -> list[Item]:
    """Feed each item's context but its last token one token per pass (openings of different lengths
    end together); returns the items with that last token as their context, for `score`."""
    width = max(len(item.context) for item in items)
    for t in range(width - 1):
        pieces = [[item.context[t - width + len(item.context)]] if t >= width - len(item.context) else [] for item in items]
        if any(pieces):
            gen.step(cache, pieces)
    return [Item(item.context[-1:], item.target, item.reference, item.asked) for item in items]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=data_path("botchan.txt"),
                        help="filler: a text file, or a JSON-lines file of documents (`document`: "
                             "../shared/data/xsum_dev.jsonl, news articles)")
    parser.add_argument("--caches", nargs="+", default=["full", "h2o:256", "streaming:256", "local:256"],
                        help="`full` or policy:budget")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="filler tokens (the issue's grid adds 4096 8192: hours on a CPU)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--chat", type=int, nargs="*", default=None,
                        help="multi-turn instead: numbers of filler turns between telling and asking")
    parser.add_argument("--keys", type=int, default=10, help="keys (or facts) per cell")
    parser.add_argument("--facts", type=int, default=0, help="secrets of different kinds per prompt, asked for in turn (0: one key)")
    parser.add_argument("--list", type=int, default=0, dest="listing",
                        help="aggregation instead: this many secrets of different kinds in one prompt, all asked for in one answer")
    parser.add_argument("--fact", action="store_true", help="plant a secret city instead of a 5-digit key")
    parser.add_argument("--batch", type=int, default=20, help="rows per forward pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vary", action="store_true",
                        help="one-prompt cells: each key in a passage of its own (the i-th i x (length + 1009) tokens "
                             "into the filler), so a cell averages over passages; default: every key in the first "
                             "`length` tokens, a cell one passage (prefilled once)")
    parser.add_argument("--opening", choices=("decode", "prefill"), default="decode",
                        help="feed the answer's opening one token per pass, as a reply is decoded (default), or as one chunk")
    parser.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="override CacheConfig fields of the evicting caches, e.g. --set recall_interval=1")
    add_model_args(parser)
    args = parser.parse_args(argv)
    try:
        settings = dict(item.split("=", 1) for item in args.set)
        for spec in args.caches:
            cache_config(spec, settings)
    except ValueError as error:
        parser.error(f"--set: {error}")
    if args.fact and args.keys > len(CITIES):
        parser.error(f"--fact has {len(CITIES)} cities, fewer than --keys {args.keys}")
    for flag, n in (("--facts", args.facts), ("--list", args.listing)):
        if n and not 1 <= n <= len(KINDS):
            parser.error(f"{flag} takes 1..{len(KINDS)}")

    model, tokenizer = load(args)
    gen = Generator(model, tokenizer)
    window = getattr(model.config, "max_position_embeddings", None)
    text, skip = filler_text(args.text)
    planted = secrets(args.keys, args.fact, args.seed)
    filler = [] if args.chat is not None else tokenizer.encode(text, add_special_tokens=False)[skip:]
    if args.facts:
        cells, deep = [], []
        for length in args.lengths:
            sets = [facts_prompts(gen, filler[:length], args.facts, args.seed + i) for i in range(args.keys)]
            prefix = sets[0][0]  # the text before the first needle does not depend on the keys
            assert all(p == prefix for p, _ in sets)
            for k in range(args.facts):
                label = f"{length} tok, fact {k + 1} of {args.facts}"
                cells.append((label, prefix, [chats[k] for _, chats in sets]))
                deep.append(label)
    elif args.listing:
        cells, deep = [], []
        for length in args.lengths:
            sets = [listing_prompt(gen, filler[:length], args.listing, args.seed + i) for i in range(args.keys)]
            assert all(p == sets[0][0] for p, _ in sets)  # the text before the first needle is shared
            cells.append((f"{length} tok, {args.listing} keys", sets[0][0], [chat for _, chat in sets]))
    elif args.chat is not None:
        words = text.split()[skip // 2:]
        cells, deep = [(f"{n} turns", [], [chat_prompt(gen, words, s, n) for s in planted]) for n in args.chat], []
    else:
        cells, deep = [], []  # deep: the cells of the goal, depths >= 50%
        for length in args.lengths:
            for depth in args.depths:
                if args.vary:
                    prefix, chats = varied_prompts(gen, filler, length, planted, depth)
                else:
                    probes = [single_prompt(gen, filler[:length], s, depth) for s in planted]
                    prefix, chats = probes[0][0], [item for _, item in probes]
                cells.append((f"{length} tok, depth {depth:.0%}", prefix, chats))
                if depth >= 0.5:
                    deep.append(cells[-1][0])
    accuracy: dict[tuple[str, str], float | None] = {}
    for spec in args.caches:
        config = cache_config(spec, settings)
        gen.looker = reread.looker(model, config)  # the re-reads' looks on the fast step, as the server's
        for label, prefix, items in cells:
            longest = len(prefix) + max(chat.tokens + len(chat.item.target) for chat in items)
            if not config.evicts and window and longest > window:
                accuracy[(spec, label)] = None  # the full cache cannot hold more than the model's window
                continue
            began = time.perf_counter()
            accuracy[(spec, label)] = recalled(gen, config, prefix, items, args.batch, args.opening == "decode") / len(items)
            print(f"{spec} {label}: {accuracy[(spec, label)]:.2f} ({time.perf_counter() - began:.0f} s)",
                  file=sys.stderr, flush=True)
    what = "secret city" if args.fact else "5-digit pass key"
    mode = "multi-turn chat" if args.chat is not None else "one prompt"
    if args.facts:
        what, mode = f"set of {args.facts} secrets (pass key, city, animal, fruit)", "one prompt, asked in turn"
    if args.listing:
        what, mode = f"list of {args.listing} secrets", "one prompt, all in one answer"
    rows = [[label, len(prefix) + max(chat.tokens for chat in items), *(
        "n/a" if accuracy[(spec, label)] is None else f"{accuracy[(spec, label)]:.2f}" for spec in args.caches)]
        for label, prefix, items in cells]
    rows.append(["mean", "", *(_mean([accuracy[(spec, label)] for label, _, _ in cells]) for spec in args.caches)])
    print(markdown_table(["cell", "prompt tokens", *args.caches], rows,
                         f"Recall of a {what} ({mode}), {args.keys} per cell, greedy after a forced opening; "
                         f"model window {window}"))
    lines = targets({spec: [accuracy[(spec, label)] for label in deep] for spec in args.caches})
    if lines:
        print("\n".join(["", *lines]))


def targets(deep: dict[str, list[float | None]]) -> list[str]:
    """The issue's goal, per evicting cache: accuracy at depths >= 50% within 10 points of full's."""
    if "full" not in deep or any(a is None for a in deep["full"]) or not deep["full"]:
        return []
    ceiling = sum(deep["full"]) / len(deep["full"])
    lines = []
    for spec, accuracies in deep.items():
        if spec == "full" or any(a is None for a in accuracies):
            continue
        mean = sum(accuracies) / len(accuracies)
        gap = round(100 * (ceiling - mean))
        lines.append(f"- {spec} at depths >= 50%: {mean:.2f} against full's {ceiling:.2f}, {gap} points below "
                     f"(goal: within 10): {'met' if gap <= 10 else 'MISSED'}")
    return lines


def _mean(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{sum(known) / len(known):.2f}" if known else "n/a"


if __name__ == "__main__":
    main()
