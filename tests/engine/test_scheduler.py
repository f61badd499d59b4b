import pytest

from h2o_cache import CacheConfig, Generator
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, Status
from server.engine.session import Session
from server.engine.turn import Turn
from server.engine.types import EngineNotReady, QueueFull


def sequence(gen, n_tokens: int, to_prefill: int = 0) -> Sequence:
    """A prefilled waiting sequence whose cache row is recognisable by its `seen` count, with
    `to_prefill` tokens of its turn still to feed."""
    cache = gen.new_cache(1)
    gen.prefill(cache, [list(range(3, 3 + n_tokens))])
    turn = Turn([], "", [7] * to_prefill, 0, 0, False)
    return Sequence(Session(str(n_tokens), ""), turn, None, channel=None, cache=cache)


def test_rows_follow_their_sequences_through_joins_and_leaves(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    scheduler = Scheduler(gen.new_cache(0), max_batch_size=8, max_queue=8)
    seqs = [sequence(gen, n) for n in (1, 2, 3, 4, 5)]
    for seq in seqs:
        scheduler.reserve()
        scheduler.waiting.append(seq)
        scheduler.join(seq)
    for leaving in (seqs[1], seqs[4], seqs[0]):
        cache = scheduler.leave(leaving)
        assert cache.seen == [int(leaving.session.id)] and leaving.status is Status.FINISHED
        assert [int(s.session.id) for s in scheduler.running] == scheduler.batch.seen
    assert sorted(scheduler.batch.seen) == [3, 4] and scheduler.in_flight == 2


def test_reserve_bounds_requests_in_flight(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    scheduler = Scheduler(gen.new_cache(0), max_batch_size=1, max_queue=2)
    scheduler.reserve()
    scheduler.reserve()
    with pytest.raises(QueueFull):
        scheduler.reserve()
    scheduler.unreserve()
    scheduler.reserve()


def test_prefill_waits_for_a_free_row(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    scheduler = Scheduler(gen.new_cache(0), max_batch_size=1, max_queue=4)
    first, second = sequence(gen, 2, 5), sequence(gen, 3, 5)
    scheduler.waiting.extend([first, second])
    assert scheduler.next_prefills(tokens=100, chunk=8) == [first]  # one row free: one sequence
    scheduler.join(first)
    assert scheduler.next_prefills(tokens=100, chunk=8) == []
    scheduler.leave(first)
    assert scheduler.next_prefills(tokens=100, chunk=8) == [second]


def test_prefill_takes_the_oldest_sequences_within_the_token_budget(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    scheduler = Scheduler(gen.new_cache(0), max_batch_size=8, max_queue=8)
    seqs = [sequence(gen, 1, n) for n in (30, 5, 9, 2)]
    scheduler.waiting.extend(seqs)
    assert scheduler.next_prefills(tokens=20, chunk=8) == seqs[:2]  # 8 + 5; the third's 8 would pass 20
    assert scheduler.next_prefills(tokens=100, chunk=8) == seqs
    assert scheduler.next_prefills(tokens=3, chunk=8) == seqs[:1]  # the oldest always goes


def test_nothing_is_queued_once_stopping(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig(policy="full"))
    scheduler = Scheduler(gen.new_cache(0), max_batch_size=1, max_queue=4)
    scheduler.stop()
    with pytest.raises(EngineNotReady):
        scheduler.add(sequence(gen, 2))
    assert scheduler.wait_for_work() is False and scheduler.drain() == []
