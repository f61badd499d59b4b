"""The HTTP-side benchmark: its stub engine speaks the engine's contract, and the program counts
every token a stream delivers (it exits 1 when any is missing)."""

import asyncio
import json

import httpx
import pytest

from h2o_cache import SamplingParams
from clients import http_bench
from server.app import create_app
from server.engine.stub import StubEngine
from server.engine.types import ChatRequest
from server.settings import ServerSettings


@pytest.fixture
def stub():
    engine = StubEngine(step_seconds=0.001, max_batch_size=2)
    engine.start()
    yield engine
    engine.stop()


async def test_stub_engine_streams_max_tokens_tokens_through_the_real_app(stub):
    app = create_app(ServerSettings(), engine=stub)
    body = {"model": "m", "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "go"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        replies = [await client.post("/v1/chat/completions", json=body) for _ in range(3)]
        plain = await client.post("/v1/chat/completions", json=body | {"stream": False, "max_tokens": 3})
    for r in replies:
        data = [line[6:] for line in r.text.splitlines() if line]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
            " t0 t1 t2 t3 t4"
        assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert plain.json()["choices"][0]["message"]["content"] == " t0 t1 t2"
    assert plain.json()["choices"][0]["finish_reason"] == "length"


async def test_a_cancelled_reply_leaves_the_stub_engine(stub):
    handle = await stub.submit(ChatRequest([{"role": "user", "content": "go"}], SamplingParams(max_new_tokens=10**6)))
    async for _ in handle:
        break  # leaving the iteration cancels the request
    for _ in range(2000):  # the engine drops it at its next step
        if not stub._replies:
            break
        await asyncio.sleep(0.001)
    assert stub._replies == []


def test_the_benchmark_counts_every_token_of_every_stream(capsys, tmp_path):
    assert http_bench.main(["--streams", "1", "3", "--tokens", "30", "--step-ms", "1",
                            "--variants", "h11/asyncio", "--log", str(tmp_path / "log")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("h11/asyncio")]
    assert [row[1] for row in rows] == ["1", "3"] and all(row[-1] == "True" for row in rows)
