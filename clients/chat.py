"""Interactive terminal chat with streamed replies; the conversation keeps its server-side session.

    python -m clients.chat                          # http://127.0.0.1:8000
    python -m clients.chat --base-url http://127.0.0.1:8080 --system "You are terse."

Commands: /reset starts a new conversation, /exit (or Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from clients.api import DEFAULT_URL, ApiError, Conversation, ServerUnavailable, make_client, served_model, wait_ready

try:
    import readline  # noqa: F401  (imported for its side effect: line editing and history in input())
except ImportError:  # not on every platform; input() works without it
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_URL)
    p.add_argument("--api-key", help="bearer token, when the server runs with --api-key")
    p.add_argument("--model", help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--history", choices=["session", "resend"], default="session",
                   help="session: send only the new message with X-Session-ID; resend: the whole history")
    p.add_argument("--no-stats", action="store_true", help="hide the per-reply latency and cache line")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server's /health")
    return p.parse_args(argv)


def say(text: str) -> None:
    print(text, end="", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    # One loop for the whole chat: the HTTP client and its keep-alive connection live on it,
    # while input() stays on the main thread so Ctrl-C interrupts it.
    loop = asyncio.new_event_loop()
    client = make_client(args.base_url, args.api_key)
    try:
        try:
            loop.run_until_complete(wait_ready(client, args.wait))
        except ServerUnavailable as e:
            print(f"error: {e}\n(start one with: python -m server)", file=sys.stderr)
            return 1
        model = args.model or loop.run_until_complete(served_model(client))
        conv = Conversation(resend=args.history == "resend", system=args.system)
        print(f"connected to {args.base_url} ({model}); /reset starts over, /exit quits")
        failed = False
        while True:
            try:
                line = input("\nyou> ").strip()
            except EOFError:
                print()
                break
            if line == "/exit":
                break
            if line == "/reset":
                conv.reset()
                print("(new conversation)")
                continue
            if not line:
                continue
            say("assistant> ")
            try:
                turn = loop.run_until_complete(conv.ask(client, line, model=model, max_tokens=args.max_tokens,
                                                        temperature=args.temperature, on_text=say))
            except (ApiError, ServerUnavailable) as e:
                failed = True
                print(f"\nerror: {e}", file=sys.stderr)
                continue
            failed = False
            if not args.no_stats:
                u = turn.usage
                say(f"\n  [ttft {turn.ttft:.2f}s · {turn.decode_tps:.1f} tok/s · conversation "
                    f"{u.get('conversation_tokens', '?')} tokens · KV cache {u.get('kv_resident_tokens', '?')}]")
            print()
        return 1 if failed else 0  # a script piping stdin learns whether its last message was answered
    except KeyboardInterrupt:
        print("\n(interrupted)")
        return 130
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())  # httpx's inner stream generators, if cut short
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
