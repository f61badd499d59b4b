import asyncio
import threading

import pytest

from server.engine.handle import Channel, Handle
from server.engine.types import Delta, Finish, GenerationFailed, Usage

FINISH = Finish("stop", Usage(3, 2, 0, 5, 5))


def make_handle():
    cancels = []
    channel = Channel(asyncio.get_running_loop())
    return Handle("s", 3, 0, channel, on_cancel=lambda: cancels.append(1)), channel, cancels


async def test_items_put_from_another_thread_stream_in_order_and_end_at_finish():
    handle, channel, cancels = make_handle()
    items = [Delta("a"), Delta("b"), FINISH, Delta("never")]
    thread = threading.Thread(target=lambda: [channel.put(item) for item in items])
    thread.start()
    thread.join()
    assert [item async for item in handle] == items[:3]
    assert cancels == []


async def test_an_error_raises_generation_failed():
    handle, channel, _ = make_handle()
    channel.put(Delta("a"))
    channel.put(RuntimeError("boom"))
    seen = []
    with pytest.raises(GenerationFailed, match="boom"):
        async for item in handle:
            seen.append(item)
    assert seen == [Delta("a")]


async def test_cancel_ends_a_waiting_iteration_and_notifies_the_engine_once():
    handle, _, cancels = make_handle()

    async def consume():
        return [item async for item in handle]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0)
    handle.cancel()
    handle.cancel()
    assert await asyncio.wait_for(task, 1) == [] and cancels == [1]


async def test_leaving_the_stream_early_cancels():
    handle, channel, cancels = make_handle()
    channel.put(Delta("a"))
    stream = aiter(handle)
    assert await anext(stream) == Delta("a")
    await stream.aclose()
    assert cancels == [1]


def test_put_after_the_loop_closed_reports_it():
    loop = asyncio.new_event_loop()
    channel = Channel(loop)
    loop.close()
    assert channel.put(Delta("a")) is False
