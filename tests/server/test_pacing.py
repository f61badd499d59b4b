"""Keep-alive comments through a silent stream, and the per-request deadline."""

import asyncio

import pytest

from server.errors import APIError
from server.routes.pacing import paced


async def slow(delays):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield i


async def test_silence_is_filled_with_keepalives_and_items_keep_their_order():
    got = [item async for item in paced(slow([0.0, 0.25, 0.0]), keepalive=0.1, timeout=None)]
    assert [g for g in got if g is not None] == [0, 1, 2]
    assert 1 <= got.count(None) <= 3 and got[0] == 0 and got.index(1) > got.index(None)


async def test_the_deadline_ends_the_stream_with_a_timeout_error_and_stops_reading():
    cancelled = asyncio.Event()

    async def endless():
        try:
            yield 0
            await asyncio.sleep(10)
            yield 1
        finally:
            cancelled.set()

    got = []
    with pytest.raises(APIError) as info:
        async for item in paced(endless(), keepalive=0.05, timeout=0.2):
            got.append(item)
    assert info.value.status == 504 and info.value.code == "request_timeout"
    assert got[0] == 0 and None in got
    await asyncio.wait_for(cancelled.wait(), 1)
