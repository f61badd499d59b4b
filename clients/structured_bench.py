"""Structured outputs, measured: do replies validate against their schema, and what does the grammar cost?

    python -m clients.structured_bench                  # starts the server on the default model
    python -m clients.structured_bench --url URL        # a server already running

1. Validity: 50 (schema, prompt) pairs (10 subjects x 5 schema shapes: flat, enums and booleans,
   arrays, nested objects, optional fields), each asked with `response_format: json_schema` at
   temperature 0 and at 1. A reply counts as valid when it parses and `jsonschema` validates it;
   one cut by max_tokens (finish_reason "length") is counted apart, as truncated.
2. Cost: decode tokens/s of a row under a grammar against a row without one, at batch 1 and 8
   (8 concurrent requests, all constrained or all free). Both generate exactly max_tokens: the free
   rows ignore EOS, the grammar asks for more words than fit; a row's rate is (tokens after the
   first) / (time from its first to its last token). Free and constrained rounds
   alternate, so that a machine whose load drifts (ours is shared) weighs on both alike.
Talks HTTP only. Prints tables; exit status 1 when a reply that was not truncated failed to validate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import jsonschema

from clients.api import make_client, stream_chat, wait_ready
from clients.loadbench import format_table
from clients.server_proc import spawned_server

SUBJECTS = ["a person", "a book", "a city", "a recipe", "a movie", "a planet", "a car", "a company", "a song",
            "an animal"]
TEXT = {"type": "string", "maxLength": 30}


def shapes(subject: str) -> list[tuple[str, dict]]:
    """Five (prompt, schema) pairs about one subject, from flat to nested."""
    return [
        (f"Describe {subject} with a name and a number from 1 to 100.",
         {"type": "object", "properties": {"name": TEXT, "number": {"type": "integer", "minimum": 1, "maximum": 100}},
          "required": ["name", "number"], "additionalProperties": False}),
        (f"Is {subject} popular? Give its size as small, medium or large.",
         {"type": "object", "properties": {"popular": {"type": "boolean"},
                                           "size": {"enum": ["small", "medium", "large"]}},
          "required": ["popular", "size"], "additionalProperties": False}),
        (f"List up to three words about {subject}.",
         {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                                     "minItems": 1, "maxItems": 3}},
          "required": ["words"], "additionalProperties": False}),
        (f"Give {subject} a title, a year and a rating out of 10.",
         {"type": "object", "properties": {"title": TEXT, "details": {
             "type": "object", "properties": {"year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                              "rating": {"type": "number", "minimum": 0, "maximum": 10}},
             "required": ["year", "rating"], "additionalProperties": False}},
          "required": ["title", "details"], "additionalProperties": False}),
        (f"Name {subject}; add a short note only if you like.",
         {"type": "object", "properties": {"name": TEXT, "note": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"enum": ["old", "new", "famous"]},
                                                    "maxItems": 2}},
          "required": ["name"], "additionalProperties": False}),
    ]


def cases(n: int = 50) -> list[tuple[str, dict]]:
    return [case for subject in SUBJECTS for case in shapes(subject)][:n]


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


async def validity(client, temperature: float, max_tokens: int, concurrency: int, n: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    counts = {"valid": 0, "invalid": 0, "truncated": 0}
    failures = []

    async def one(i: int, prompt: str, schema: dict) -> None:
        async with gate:
            turn = await stream_chat(client, [{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                     temperature=temperature, extra={"response_format": response_format(schema),
                                                                     "seed": i})
        if turn.finish_reason == "length":
            counts["truncated"] += 1
            return
        try:
            jsonschema.validate(json.loads(turn.text), schema)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as error:
            counts["invalid"] += 1
            failures.append(f"  {prompt!r}: {turn.text!r} ({type(error).__name__})")

    await asyncio.gather(*(one(i, prompt, schema) for i, (prompt, schema) in enumerate(cases(n))))
    return counts | {"failures": failures}


# 40 words cannot fit in the cost part's max_tokens: a constrained row runs as long as a free one
WORDS = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "minItems": 40}},
         "required": ["words"]}


async def rates(client, batch: int, max_tokens: int, rounds: int) -> dict[bool, tuple[float, float]]:
    """Per kind (constrained or not): mean decode tokens/s of a row and mean tokens per row, over
    `rounds` rounds of `batch` rows each, the two kinds' rounds alternating."""
    turns = {False: [], True: []}
    for r in range(rounds):
        for constrained in (False, True):
            extra = {"ignore_eos": True} | ({"response_format": response_format(WORDS)} if constrained else {})
            turns[constrained] += await asyncio.gather(*(
                stream_chat(client, [{"role": "user", "content": f"List many words about {SUBJECTS[(r + i) % 10]}."}],
                            max_tokens=max_tokens, temperature=1.0, extra=extra | {"seed": r * batch + i})
                for i in range(batch)))
    out = {}
    for constrained, done in turns.items():
        measured = [t for t in done if t.completion_tokens > 2]
        out[constrained] = (statistics.mean(t.decode_tps for t in measured),
                            statistics.mean(t.completion_tokens for t in measured))
    return out


async def run(url: str, args) -> int:
    async with make_client(url) as client:
        await wait_ready(client, timeout=600)
        rows, bad = [], 0
        for temperature in (0.0, 1.0) if args.part in ("all", "validity") else ():
            c = await validity(client, temperature, args.max_tokens, args.concurrency, args.cases)
            done = c["valid"] + c["invalid"]
            rows.append([f"{temperature:g}", str(len(cases(args.cases))), str(c["valid"]), str(c["invalid"]), str(c["truncated"]),
                         f"{c['valid'] / done:.0%}" if done else "-"])
            bad += c["invalid"]
            for line in c["failures"]:
                print(line)
        if rows:
            print("json_schema replies against their schema (jsonschema.validate):")
            print(format_table(["temperature", "cases", "valid", "invalid", "truncated", "valid of not truncated"],
                               rows))
        rows = []
        for batch in (1, 8) if args.part in ("all", "cost") else ():
            measured = await rates(client, batch, args.cost_tokens, args.rounds)
            (free, free_len), (held, held_len) = measured[False], measured[True]
            rows.append([str(batch), f"{free:.1f}", f"{free_len:.0f}", f"{held:.1f}", f"{held_len:.0f}",
                         f"{held / free:.2f}x"])
        if not rows:
            return 1 if bad else 0
        print(f"\ndecode tokens/s per row, temperature 1, max_tokens {args.cost_tokens}, {args.rounds} rounds:")
        print(format_table(["batch", "free tok/s", "free tokens", "constrained tok/s", "constrained tokens",
                            "constrained / free"], rows))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server; unset: start one on --model")
    parser.add_argument("--model", help="model for the server this program starts (default: the embedded one)")
    parser.add_argument("--cases", type=int, default=50, help="(schema, prompt) pairs, at most 50")
    parser.add_argument("--max-tokens", type=int, default=200, help="max_tokens of the validity requests")
    parser.add_argument("--concurrency", type=int, default=8, help="validity requests in flight at once")
    parser.add_argument("--cost-tokens", type=int, default=64, help="max_tokens of the cost requests")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each batch size in the cost part")
    parser.add_argument("--part", choices=["all", "validity", "cost"], default="all", help="which part to run")
    parser.add_argument("--log", type=Path, default=Path("structured_bench.log"), help="the started server's log")
    args = parser.parse_args(argv)
    if args.url:
        return asyncio.run(run(args.url, args))
    server_args = ["--max-batch-size", "8"] + (["--model", args.model] if args.model else [])
    with spawned_server("h2o", server_args, log=args.log) as url:
        return asyncio.run(run(url, args))


if __name__ == "__main__":
    sys.exit(main())
