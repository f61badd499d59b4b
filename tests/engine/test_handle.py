import asyncio
import threading

import pytest

from server.engine.handle import Channel, Handle, Outbox
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


async def test_batches_hold_everything_that_arrived_and_end_at_finish():
    handle, channel, cancels = make_handle()
    for item in (Delta("a"), Delta("b")):
        channel.put(item)
    await asyncio.sleep(0)
    stream = handle.batches()
    assert await anext(stream) == [Delta("a"), Delta("b")]
    channel.put(Delta("c"))
    channel.put(FINISH)
    channel.put(Delta("never"))
    await asyncio.sleep(0)
    assert [batch async for batch in stream] == [[Delta("c"), FINISH]] and cancels == []


async def test_batches_yield_what_came_before_an_error():
    handle, channel, _ = make_handle()
    channel.put(Delta("a"))
    channel.put(RuntimeError("boom"))
    await asyncio.sleep(0)
    seen = []
    with pytest.raises(GenerationFailed, match="boom"):
        async for batch in handle.batches():
            seen.append(batch)
    assert seen == [[Delta("a")]]


async def test_an_outbox_delivers_in_order_per_channel_with_one_wake_up():
    loop = asyncio.get_running_loop()
    first, second = Channel(loop), Channel(loop)
    outbox = Outbox()
    wakeups = []
    call = loop.call_soon_threadsafe

    def counting(*args):
        wakeups.append(1)
        return call(*args)

    loop.call_soon_threadsafe = counting
    try:
        for i in range(3):
            outbox.put(first, Delta(f"1-{i}"))
            outbox.put(second, Delta(f"2-{i}"))
        thread = threading.Thread(target=outbox.flush)
        thread.start()
        thread.join()
    finally:
        del loop.call_soon_threadsafe
    await asyncio.sleep(0)
    assert [first.queue.get_nowait().text for _ in range(3)] == ["1-0", "1-1", "1-2"]
    assert [second.queue.get_nowait().text for _ in range(3)] == ["2-0", "2-1", "2-2"]
    assert wakeups == [1] and outbox.flush() == []


def test_an_outbox_reports_channels_whose_loop_is_gone():
    loop = asyncio.new_event_loop()
    channel = Channel(loop)
    loop.close()
    outbox = Outbox()
    outbox.put(channel, Delta("a"))
    assert outbox.flush() == [channel]
