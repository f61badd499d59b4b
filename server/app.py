"""The app factory: shared objects hang off `app.state`; the model loads in the background at start-up."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from h2o_cache import load_model
from h2o_cache.loading import model_name
from h2o_cache.prefill_products import apply_prefill_dtype
from server.engine import Engine
from server.errors import install_error_handlers
from server.metrics import CountResponses, RequestCounter, registry
from server.request_id import RequestIds
from server.routes import (
    chat_router, sessions_router, status_router, text_completion_router, tokenize_router, web_router,
)
from server.routes.auth import key_owners
from server.routes.web import static_files
from server.settings import ServerSettings

log = logging.getLogger("server")


def build_engine(settings: ServerSettings) -> Engine:
    """Load the model and start an engine on it (seconds to minutes: runs off the event loop)."""
    torch.set_num_threads(settings.torch_threads())
    model, tokenizer = load_model(settings.model, settings.device, settings.dtype)
    if apply_prefill_dtype(model, settings.prefill_dtype):
        what = ("every product on the GGUF blocks with int8 activations" if settings.prefill_dtype == "int8"
                else "the MLP's products in bf16, the rest in float32")
        log.info("prefill: %s (--prefill-dtype %s); decode steps as configured", what, settings.prefill_dtype)
    elif settings.prefill_dtype == "int8":
        log.warning("--prefill-dtype int8 needs a GGUF model on the CPU and the compiled kernel: prefill stays float32")
    # Only the `full` policy is bounded by the model's context; evicting policies roll positions.
    context_window = getattr(model.config, "max_position_embeddings", None)
    cache_config = settings.cache_config(next(model.parameters()).device.type)
    engine = Engine(model, tokenizer, cache_config, settings.engine_config(context_window))
    # what exists now (the model, the tokenizer, the libraries: ~380k objects) lives as long as the
    # server: out of the collector's sight, so that a full collection while serving walks only what
    # came since (walking everything took 0.2-0.3 s, a pause every stream would feel)
    gc.collect()
    gc.freeze()
    engine.start()
    log.info("model %s ready: %s", model_name(settings.model), cache_config.describe())
    return engine


class EngineLoader:
    """Builds the engine on a daemon thread and publishes it on `app.state` from the event loop.

    A daemon thread rather than the loop's executor: a server stopped during loading must not wait
    for the load to finish. An engine that arrives after shutdown is stopped at once.
    """

    def __init__(self, app: FastAPI, on_failure: Callable[[BaseException], None] | None):
        self.app = app
        self.on_failure = on_failure
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.thread = threading.Thread(target=self._load, name="model-loader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _load(self) -> None:
        try:
            engine = build_engine(self.app.state.settings)
        except Exception as exc:  # any load failure leaves the server unable to serve
            log.exception("loading the model failed")
            self.app.state.load_error = f"{type(exc).__name__}: {exc}"
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        try:
            self.loop.call_soon_threadsafe(self._publish, engine)
        except RuntimeError:  # the loop is already closed
            engine.stop()

    def _publish(self, engine: Engine) -> None:
        if self.closed:
            engine.stop()
        else:
            self.app.state.engine = engine

    def close(self) -> None:
        self.closed = True
        if self.app.state.engine is not None:
            self.app.state.engine.stop()
            self.app.state.engine = None


def create_app(settings: ServerSettings, engine: Engine | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app.

    engine: an already started engine (or a stand-in with the same API), whose lifetime the
        caller owns; None: the app loads `settings.model` when it starts and stops the engine at
        shutdown. Until the engine exists, /health and chat requests answer 503.
    on_load_failure: called from the loader thread if the model cannot be loaded.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if app.state.engine is not None:
            yield
            return
        loader = EngineLoader(app, on_load_failure)
        loader.start()
        try:
            yield
        finally:
            loader.close()

    app = FastAPI(title="h2o-chat", summary="OpenAI-compatible chat with fixed-budget H2O KV caches",
                  lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.load_error = None
    app.state.model_name = settings.served_model_name or model_name(settings.model)
    app.state.key_owners = key_owners(settings.api_key)
    app.state.requests = RequestCounter()
    app.state.metrics = registry(app.state.requests,
                                 lambda: app.state.engine.stats() if app.state.engine is not None else None)
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.add_middleware(CountResponses, counter=app.state.requests)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Session-ID", "X-Request-Id"])
    app.add_middleware(RequestIds)  # outermost: even a refused CORS preflight carries its id
    app.include_router(chat_router)
    app.include_router(text_completion_router)
    app.include_router(tokenize_router)
    app.include_router(status_router)
    app.include_router(sessions_router)
    app.include_router(web_router)
    app.mount("/static", static_files(), name="static")
    return app
