"""Restarts: conversations survive a graceful restart and a crash, and no completed turn is lost.

    python -m clients.restart                          # embedded model: 3 rounds of each kind + the target
    python -m clients.restart --model DIR --rounds 1 --conversations 3 --target-turns 6   # quick

Starts `python -m server` with a state dir, then alternates rounds of two kinds:
- graceful: SIGTERM while a few other streams are in flight (they must finish), restart;
- kill: SIGKILL while a few other streams are in flight, restart.
In each round every tracked conversation takes `--turns` turns by session id, then the server
restarts, then every conversation continues by its session id. A conversation passes the round when
- the server still knows its session (no 404);
- a graceful restart resumed it from its snapshot without prefill (`cached_tokens` = the tokens the
  conversation had consumed at the last turn the client saw complete), a crash from its transcript
  (`cached_tokens` 0: prefilled again);
- no completed turn is lost: a resumed cache holds exactly those tokens; a prefilled one counts the
  `prompt_tokens` that the client's own history, re-sent in full by another API key (whose sessions
  never match this one), counts.

The target: a `--target-turns`-turn session and its twin (the same turns, one after the other) are
built; the twin's next reply is computed before a graceful restart; after it, the session's next reply
must come from its snapshot (whole history cached) in under `--target-seconds`, with the same tokens.
Then a SIGKILL and the transcript path is timed for comparison. Talks HTTP only; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from clients.api import ApiError, ServerUnavailable, Turn, make_client, stream_chat
from clients.loadbench import format_table
from clients.server_proc import ServerFailed, free_port, start_server, stop_server

OWNER, CHECKER = "restart-client", "restart-checker"  # two API keys: the checker's sessions never match


@dataclass
class Tracked:
    """A conversation as the client saw it: only turns whose reply arrived whole are in `messages`."""

    name: str
    messages: list[dict] = field(default_factory=list)
    session_id: str | None = None
    consumed: int = 0  # usage.conversation_tokens of its last completed turn, less the passages re-read
    reread: int = 0  # usage.reread_tokens over its completed turns (cached_tokens leaves them out)

    def question(self) -> str:
        return f"{self.name}, turn {len(self.messages) // 2 + 1}: tell me one more thing."


@dataclass
class Round:
    kind: str
    conversations: int = 0
    noise: int = 0  # streams in flight at the signal
    continued: int = 0
    not_found: int = 0
    lost: int = 0  # conversations whose server-side history is not the client's
    resumed_as_expected: int = 0  # graceful: from the snapshot, no prefill; kill: from the transcript
    noise_done: int = 0  # streams in flight at the signal that still completed
    restart_s: float = float("nan")
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        whole = self.continued == self.resumed_as_expected == self.conversations
        drained = self.kind != "graceful" or self.noise_done == self.noise  # SIGTERM lets replies finish
        return whole and drained and not self.not_found and not self.lost


class Server:
    """The server process, restarted on the same port and state dir."""

    def __init__(self, args: list[str], log: Path):
        self.args, self.log, self.port = args, log, free_port()
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        started = time.perf_counter()
        self.proc, _ = start_server(self.args, self.log, port=self.port)
        return time.perf_counter() - started

    def stop(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=120)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_server(self.proc)


async def chat(url: str, key: str, messages: list[dict], max_tokens: int, session_id: str | None = None) -> Turn:
    async with make_client(url, key, timeout=600) as client:
        return await stream_chat(client, messages, max_tokens=max_tokens, session_id=session_id,
                                 extra={"ignore_eos": True})


async def take_turn(url: str, conv: Tracked, max_tokens: int) -> Turn:
    """One turn by session id (the first one creates the session); recorded once its reply is whole."""
    user = {"role": "user", "content": conv.question()}
    turn = await chat(url, OWNER, [user], max_tokens, conv.session_id)
    conv.messages += [user, {"role": "assistant", "content": turn.text}]
    conv.session_id = turn.session_id
    continued = turn.usage["prompt_tokens_details"]["cached_tokens"] > 0  # else a fresh cache: none re-read yet
    conv.reread = (conv.reread if continued else 0) + turn.usage.get("reread_tokens", 0)
    conv.consumed = turn.usage["conversation_tokens"] - conv.reread
    return turn


async def check(url: str, conv: Tracked, max_tokens: int, kind: str, result: Round) -> None:
    """Continue a conversation after the restart and judge what the server kept."""
    resent = [*conv.messages, {"role": "user", "content": conv.question()}]
    consumed = conv.consumed
    try:
        turn = await take_turn(url, conv, max_tokens)
    except ApiError as e:
        result.not_found += e.status == 404
        result.problems.append(f"{conv.name}: {e}")
        return
    result.continued += 1
    usage = turn.usage
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    if cached == (consumed if kind == "graceful" else 0):
        result.resumed_as_expected += 1
    else:
        result.problems.append(f"{conv.name}: cached_tokens {cached} after a {kind} restart ({consumed} consumed)")
    if cached:
        # Resumed from a snapshot: it holds exactly the tokens of the last turn the client saw complete.
        whole = cached == consumed
    else:
        # Prefilled from the transcript: its prompt must count what the client's history does, as
        # re-sent by another key (whose sessions never match this one). Both are tokenized from text;
        # a resumed cache counts the tokens it consumed, which re-tokenizing the text may not give.
        whole = usage["prompt_tokens"] == (expected := (await chat(url, CHECKER, resent, 1)).usage["prompt_tokens"])
        if not whole:
            result.problems.append(f"{conv.name}: the server's history has {usage['prompt_tokens']} prompt "
                                   f"tokens, the client's {expected}")
    result.lost += not whole


async def noise(url: str, n: int, max_tokens: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """`n` streams of other conversations; the event is set once every one has produced a token."""
    started, flowing = asyncio.Event(), set()

    def seen(i: int) -> None:
        flowing.add(i)
        if len(flowing) == n:
            started.set()

    async def one(i: int) -> bool:
        async with make_client(url, OWNER, timeout=600) as client:
            try:
                await stream_chat(client, [{"role": "user", "content": f"noise {i}"}], max_tokens=max_tokens,
                                  extra={"ignore_eos": True}, on_text=lambda _: seen(i))
                return True
            except (ApiError, ServerUnavailable):
                return False

    if n == 0:
        started.set()
    return [asyncio.create_task(one(i)) for i in range(n)], started


async def restart_round(server: Server, convs: list[Tracked], kind: str, args) -> Round:
    result = Round(kind, conversations=len(convs), noise=args.noise)
    for _ in range(args.turns):
        await asyncio.gather(*(take_turn(server.url, c, args.max_tokens) for c in convs))
    tasks, flowing = await noise(server.url, args.noise, args.noise_tokens)
    await asyncio.wait_for(flowing.wait(), timeout=300)
    await asyncio.to_thread(server.stop, signal.SIGTERM if kind == "graceful" else signal.SIGKILL)
    result.noise_done = sum(await asyncio.gather(*tasks))
    result.restart_s = await asyncio.to_thread(server.start)
    await asyncio.gather(*(check(server.url, c, args.max_tokens, kind, result) for c in convs))
    return result


@dataclass
class Target:
    turns: int
    twin_diverged: int = 0  # turns where session and twin replied differently before the restart
    same_reply: bool = False
    snapshot_ttft_s: float = float("nan")
    snapshot_turn_s: float = float("nan")
    cached: int = 0
    prompt: int = 0
    consumed: int = 0
    warm_ttft_s: float = float("nan")  # the twin's turn before the restart: a session held in memory
    transcript_ttft_s: float = float("nan")
    transcript_cached: int = -1
    snapshot_mb: float = float("nan")

    def met(self, seconds: float) -> bool:
        return self.same_reply and self.cached == self.consumed and self.snapshot_ttft_s < seconds


async def restore_target(server: Server, args) -> Target:
    target = Target(args.target_turns)
    session, twin = Tracked("target"), Tracked("target")  # the same questions
    for _ in range(args.target_turns):  # one after the other: a batch of two could round differently
        a = await take_turn(server.url, session, args.max_tokens)
        b = await take_turn(server.url, twin, args.max_tokens)
        target.twin_diverged += a.text != b.text
    reference = await take_turn(server.url, twin, args.max_tokens)
    target.warm_ttft_s = reference.ttft
    target.consumed = session.consumed
    await asyncio.to_thread(server.stop, signal.SIGTERM)
    await asyncio.to_thread(server.start)
    target.snapshot_mb = await metric(server.url, 'h2o_state_bytes{kind="snapshot"}') / 2**20
    turn = await take_turn(server.url, session, args.max_tokens)
    target.snapshot_ttft_s, target.snapshot_turn_s = turn.ttft, turn.t_end - turn.t_start
    target.cached, target.prompt = turn.usage["prompt_tokens_details"]["cached_tokens"], turn.usage["prompt_tokens"]
    target.same_reply = turn.text == reference.text and session.messages[:-1] == twin.messages[:-1]
    await asyncio.to_thread(server.stop, signal.SIGKILL)
    await asyncio.to_thread(server.start)
    turn = await take_turn(server.url, session, args.max_tokens)
    target.transcript_ttft_s, target.transcript_cached = turn.ttft, turn.usage["prompt_tokens_details"]["cached_tokens"]
    return target


async def metric(url: str, name: str) -> float:
    async with make_client(url, OWNER) as client:
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return float("nan")


async def run(args, state_dir: str, log: Path) -> tuple[list[Round], Target | None]:
    flags = ["--state-dir", state_dir, "--kv-budget", str(args.kv_budget), "--api-key", OWNER, "--api-key", CHECKER,
             "--log-level", "warning", *(["--model", args.model] if args.model else []),
             *(["--threads", str(args.threads)] if args.threads else [])]
    server = Server(flags, log)
    try:
        await asyncio.to_thread(server.start)
        convs = [Tracked(f"conversation {i}") for i in range(args.conversations)]
        rounds = [await restart_round(server, convs, kind, args)
                  for _ in range(args.rounds) for kind in ("graceful", "kill")]
        target = await restore_target(server, args) if args.target_turns else None
        return rounds, target
    finally:
        server.close()


def report(rounds: list[Round], target: Target | None, args) -> bool:
    rows = [[str(i + 1), r.kind, str(r.conversations), str(r.continued), str(r.not_found), str(r.lost),
             str(r.resumed_as_expected), f"{r.noise_done}/{args.noise}", f"{r.restart_s:.1f}"]
            for i, r in enumerate(rounds)]
    print(format_table(["round", "restart", "conversations", "continued", "404", "lost", "resumed as expected",
                        "in flight done", "restart (s)"], rows))
    for r in rounds:
        for problem in r.problems[:3]:
            print(f"  {r.kind}: {problem}")
    lost = sum(r.lost + r.not_found for r in rounds)
    completed = sum(r.conversations for r in rounds) * (args.turns + 1)
    print(f"completed turns: {completed}; conversations missing one after a restart: {lost} (target 0)")
    ok = all(r.ok for r in rounds)
    if target is not None:
        t = target
        print(f"\ntarget: a {t.turns}-turn session at budget {args.kv_budget}, restored after a graceful restart")
        print(format_table(["", "value"], [
            ["first token, from the snapshot", f"{t.snapshot_ttft_s * 1000:.0f} ms"],
            ["whole turn, from the snapshot", f"{t.snapshot_turn_s * 1000:.0f} ms ({args.max_tokens} tokens)"],
            ["first token, session in memory (twin, before the restart)", f"{t.warm_ttft_s * 1000:.0f} ms"],
            ["first token, from the transcript (after SIGKILL)", f"{t.transcript_ttft_s * 1000:.0f} ms "
                                                               f"(cached_tokens {t.transcript_cached})"],
            ["cached_tokens / prompt_tokens", f"{t.cached} / {t.prompt} (history: {t.consumed})"],
            ["same reply as the twin that never restarted", "yes" if t.same_reply else "NO"],
            ["twin turns that differed before the restart", str(t.twin_diverged)],
            ["snapshots on disk at the restart", f"{t.snapshot_mb:.1f} MB"],
        ]))
        met = t.met(args.target_seconds)
        print(f"target (< {args.target_seconds:g} s to the first token, no prefill, the same reply): "
              f"{'met' if met else 'MISSED'}")
        ok = ok and met
    print("ok" if ok else "FAILED")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the server's --model; unset: its embedded default")
    p.add_argument("--kv-budget", type=int, default=256)
    p.add_argument("--threads", type=int, help="the server's --threads")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind (graceful, kill)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=2, help="turns per conversation per round, before the restart")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--noise", type=int, default=3, help="other streams in flight when the signal comes")
    p.add_argument("--noise-tokens", type=int, default=48)
    p.add_argument("--target-turns", type=int, default=64, help="turns of the target session (0: skip)")
    p.add_argument("--target-seconds", type=float, default=1.0)
    p.add_argument("--state-dir", help="default: a temporary directory, removed at the end")
    p.add_argument("--log", type=Path, default=Path("restart-server.log"))
    args = p.parse_args(argv)
    args.log.write_text("")
    try:
        with tempfile.TemporaryDirectory(prefix="h2o-state-") as scratch:
            rounds, target = asyncio.run(run(args, args.state_dir or scratch, args.log))
    except (ServerFailed, ServerUnavailable, ApiError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if report(rounds, target, args) else 1


if __name__ == "__main__":
    sys.exit(main())
