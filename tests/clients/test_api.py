"""The shared streaming layer against the fake server: timing, sessions, and the error shapes."""

import pytest

from clients.api import ApiError, Conversation, ServerUnavailable, make_client, wait_ready


async def test_turn_records_chunks_usage_and_session(fake_server):
    async with make_client(fake_server) as client:
        seen = []
        turn = await Conversation().ask(client, "one two three", max_tokens=5, on_text=seen.append)
    assert "".join(seen) == turn.text == "w0 w1 w2 w3 w4 "
    assert len(turn.chunk_times) == turn.completion_tokens == 5
    assert turn.session_id and turn.usage["kv_resident_tokens"] == 8
    assert 0 < turn.ttft <= turn.t_end - turn.t_start
    assert len(turn.inter_token_gaps) == 4 and turn.decode_tps > 0


@pytest.mark.parametrize("resend", [True, False])
async def test_conversation_grows_the_same_in_both_history_modes(fake_server, resend):
    async with make_client(fake_server) as client:
        conv = Conversation(resend=resend, system="be brief")
        first = await conv.ask(client, "a b", max_tokens=3)
        second = await conv.ask(client, "c d", max_tokens=3)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    # The fake counts words: session mode adds only the new message to the stored session,
    # resend mode starts a fresh session holding the whole history. Both see the same conversation.
    assert second.usage["prompt_tokens"] == first.usage["conversation_tokens"] + 2
    assert (second.session_id == first.session_id) == (not resend)


async def test_a_dropped_session_is_replayed_from_history(fake_server):
    async with make_client(fake_server) as client:
        conv = Conversation(resend=False)
        first = await conv.ask(client, "a b", max_tokens=3)
        conv.session_id = "gone"  # as if the server had expired it: it answers 404
        second = await conv.ask(client, "c d", max_tokens=3)
    assert second.session_id not in ("gone", first.session_id)
    assert second.usage["prompt_tokens"] == first.usage["conversation_tokens"] + 2


async def test_http_error_carries_the_error_code(small_context_server):
    async with make_client(small_context_server) as client:
        with pytest.raises(ApiError) as e:
            await Conversation().ask(client, "word " * 100, max_tokens=3)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


async def test_error_frame_in_stream_raises(fake_server):
    async with make_client(fake_server) as client:
        with pytest.raises(ApiError) as e:
            await Conversation().ask(client, "FAIL_MIDSTREAM", max_tokens=5)
    assert e.value.status == 0 and e.value.code == "generation_failed"


async def test_unreachable_server(dead_url):
    async with make_client(dead_url) as client:
        with pytest.raises(ServerUnavailable):
            await wait_ready(client)
        with pytest.raises(ServerUnavailable):
            await Conversation().ask(client, "hello")
