"""`python -m server.stub_serve`: the real app on a `StubEngine` (no model), for measuring the HTTP side
alone (`clients.http_bench` starts it).

    python -m server.stub_serve --port 8001 --http h11 --loop asyncio --step-ms 5 [--switch-ms 0.5]
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from server.app import create_app
from server.engine.stub import StubEngine
from server.settings import ServerSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--http", default="auto", help="uvicorn's HTTP implementation (auto, h11, httptools)")
    parser.add_argument("--loop", default="auto", help="uvicorn's event loop (auto, asyncio, uvloop)")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stub engine's step time")
    parser.add_argument("--switch-ms", type=float, default=None, help="the interpreter's GIL switch interval")
    args = parser.parse_args(argv)
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1000)
    engine = StubEngine(args.step_ms / 1000)
    engine.start()
    app = create_app(ServerSettings(), engine=engine)
    uvicorn.run(app, host=args.host, port=args.port, http=args.http, loop=args.loop, log_level="warning")


if __name__ == "__main__":
    main()
