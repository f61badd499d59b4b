"""`python -m server`: parse the settings (flags and H2O_* environment), load the model, serve."""

from __future__ import annotations

import logging
import sys
import threading

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp

from server.app import create_app
from server.settings import ServerSettings


class _Server(uvicorn.Server):
    """uvicorn, and at the first SIGTERM/SIGINT a timer: replies still running just before the
    shutdown timeout end with an error frame and `data: [DONE]`, instead of a cut connection."""

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        engine = self.config.app.state.engine
        if first and engine is not None:
            timeout = self.config.timeout_graceful_shutdown or 0.0
            timer = threading.Timer(max(timeout - min(1.0, timeout / 2), 0.0), engine.abort,
                                    args=("the server is shutting down",))
            timer.daemon = True
            timer.start()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = CliApp.run(ServerSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:  # a value out of its range or choices: one line per flag, no traceback
        for error in exc.errors():
            flag = "--" + "-".join(str(part) for part in error["loc"]).replace("_", "-")
            print(f"python -m server: error: {flag}: {error['msg']} (got {error.get('input')!r})", file=sys.stderr)
        return 2
    try:
        settings.cache_config()  # refuse an inconsistent budget now, not after minutes of loading
    except ValueError as exc:
        print(f"python -m server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def stop_serving(exc: BaseException) -> None:
        server.should_exit = True  # polled by uvicorn's main loop; safe to set from the loader thread

    app = create_app(settings, on_load_failure=stop_serving)
    server = _Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level=settings.log_level,
                                           timeout_graceful_shutdown=settings.shutdown_timeout))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 1 if app.state.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
