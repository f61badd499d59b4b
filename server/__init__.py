"""OpenAI-compatible streaming chat server whose conversations each keep a fixed-budget H2O KV cache.

    python -m server --policy h2o --kv-budget 256
    server.app.create_app(ServerSettings(), engine)     # the ASGI app, e.g. for tests

Nothing is imported here, so `server.engine` stays free of the HTTP stack.
"""
