"""Re-reading (`h2o_cache.reread`): a long turn's question is followed by the passages its reply's first
steps point at, found by a look that attends to every token of the row (or through the windows of a copy
of it) and leaves the row as it was; the spans are the best positions widened and merged up to the
limit; only a body that overflows the budget is re-read."""

import random
from dataclasses import replace

import pytest
import torch

from h2o_cache import CacheConfig, Generator, StaticDecoder, reread
from h2o_cache.rope import rotate
from tests.conftest import ByteTokenizer, tiny_llama


@pytest.fixture(scope="module")
def peaked_model():
    return tiny_llama(init_std=0.3)  # peaked attention: real heavy hitters, no near-ties


def config(**overrides) -> CacheConfig:
    settings = dict(policy="h2o", budget=32, evict_slack=4, prefill_chunk=8, recall_budget=16, recall_block=4,
                    recall_probe=6, recall_archive=256, recall_reread=12, recall_reread_look=4)
    return CacheConfig(**{**settings, **overrides})


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def state(cache, row: int) -> tuple:
    n = cache.lengths[row]
    b = cache.buffers()
    archive = cache.archives[row]
    return (b.keys[:, row, :, :n].clone(), b.values[:, row, :, :n].clone(), b.scores[:, row, :, :n].clone(),
            b.origins[:, row, :, :n].clone(), cache._pinned[:, row, :, :n].clone(), cache.seen[row],
            cache.recalled[row], cache.recall_count[row], cache.due[row], len(archive) if archive else 0)


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_passages_take_the_best_positions_widened_and_merged_up_to_the_limit():
    score = torch.zeros(40, dtype=torch.int64)
    score[10], score[13], score[30], score[2] = 9, 7, 5, 1
    # 10 -> [9, 13); 13 -> [12, 16) merges into [9, 16); 30 -> [29, 33); 2 -> [1, 5)
    assert reread.passages(score, 100, before=1, after=2) == [(1, 5), (9, 16), (29, 33)]
    # the limit stops before a span is added once it is covered: [9, 16) is 7 tokens
    assert reread.passages(score, 7, before=1, after=2) == [(9, 16)]
    assert reread.passages(score, 8, before=1, after=2) == [(9, 16), (29, 33)]
    # spans are clipped to the text; nothing that scores 0 or less is taken
    assert reread.passages(score, 100, before=20, after=50) == [(0, 40)]
    assert reread.passages(torch.zeros(10, dtype=torch.int64), 100) == []
    assert reread.passages(-torch.ones(10, dtype=torch.int64), 100) == []


@pytest.mark.parametrize("lend", [False, True], ids=["copied", "lent"])
def test_a_copy_of_a_row_runs_as_the_row_and_leaves_it_as_it_was(peaked_model, lend):
    """Its archive copied, or lent (`Archive.lend`: working on the row's storage until given back)."""
    generator = Generator(peaked_model, ByteTokenizer(), config())
    cache = generator.new_cache(2)
    generator.prefill(cache, [tokens(70, 1), tokens(90, 2)])
    twin = cache.copy(1, lend=lend)
    assert same(state(twin, 0), state(cache, 1))
    before, archived = state(cache, 1), cache.archives[1].state()
    # the copy runs as the row would: the same logits for the same tokens
    ours = generator.step(twin, [[5]])[0]
    for extra in ([7, 9, 11, 13], [17]):
        generator.step(twin, [extra])
    assert len(twin.archives[0]) > len(archived["keys"][0, 0])  # the copy archived tokens of its own
    twin.archives[0].give_back()
    assert same(state(cache, 1), before)  # the row is as it was
    assert all(torch.equal(cache.archives[1].state()[name], archived[name]) for name in archived)
    mine = generator.step(cache, [[], [5]])[1]
    assert torch.allclose(ours, mine, atol=1e-5)  # one row against two in a pass: the same up to rounding


def prefill_by_hand(generator, prompt: list[int]) -> tuple[torch.Tensor, list[int], object]:
    """The body, then its excerpt, then the tail, each fed by hand: what `prefill(recall=True)` must do."""
    cache = generator.new_cache(1)
    at = generator.probe_start(prompt, cache.config)
    body, tail = prompt[:at], prompt[at:]
    generator._prefill(cache, [body], ahead=True)
    again = generator.reread(cache, 0, body, 0, tail)
    if again:
        generator._prefill(cache, [again], ahead=True)
    return generator._prefill(cache, [tail])[0], again, cache


def test_a_long_turn_is_fed_its_excerpt_between_its_body_and_its_tail(peaked_model):
    generator = Generator(peaked_model, ByteTokenizer(), config())
    prompt = tokens(120, 3)
    logits, again, by_hand = prefill_by_hand(generator, prompt)
    separator = ByteTokenizer().encode("\n\n")
    assert again[:len(separator)] == separator and again[-len(separator):] == separator
    body = prompt[:generator.probe_start(prompt, generator.config)]
    passages = [p for p in bytes(t for t in again).split(bytes(separator)) if p]
    assert passages and all(bytes(body).find(p) >= 0 for p in passages)  # pieces of the body, as they are there
    assert sum(map(len, passages)) <= generator.config.recall_reread + reread.SPAN_BEFORE + reread.SPAN_AFTER

    cache = generator.new_cache(1)
    ours = generator.prefill(cache, [prompt], recall=True)[0]
    assert cache.seen[0] == len(prompt) + len(again)
    assert torch.equal(ours, logits) and same(state(cache, 0), state(by_hand, 0))


@pytest.mark.parametrize("settings, length", [(dict(recall_reread=0), 120), ({}, 36), (dict(recall_budget=0), 120)])
def test_a_turn_is_not_re_read_when_off_short_or_without_recall(peaked_model, settings, length):
    generator = Generator(peaked_model, ByteTokenizer(), config(**settings))
    prompt = tokens(length, 4)
    cache = generator.new_cache(1)
    generator.prefill(cache, [prompt], recall=True)
    assert cache.seen[0] == len(prompt)


def test_rows_of_one_prefill_are_re_read_each_as_alone(peaked_model):
    generator = Generator(peaked_model, ByteTokenizer(), config())
    prompts = [tokens(120, 5), tokens(30, 6), tokens(100, 7)]
    cache = generator.new_cache(3)
    logits = generator.prefill(cache, prompts, recall=True)
    for row, prompt in enumerate(prompts):
        alone, again, by_hand = prefill_by_hand(generator, prompt)
        assert bool(again) == (row != 1)
        assert cache.seen[row] == len(prompt) + len(again)
        assert torch.allclose(logits[row], alone, atol=1e-5)
        assert torch.equal(cache.buffers().origins[:, row, :, :cache.lengths[row]],
                           by_hand.buffers().origins[:, 0, :, :by_hand.lengths[0]])


def test_the_look_on_a_static_decoder_gains_as_on_the_generator_and_leaves_it_empty(peaked_model):
    generator = Generator(peaked_model, ByteTokenizer(), config(recall_reread_dense=0))
    prompt = tokens(120, 8)
    cache = generator.new_cache(1)
    at = generator.probe_start(prompt, cache.config)
    generator._prefill(cache, [prompt[:at]], ahead=True)
    before = state(cache, 0)
    slow = reread.gains(generator, cache, 0, prompt[at:], 0, at, 4)
    decoder = StaticDecoder(peaked_model, generator.config, 1)
    fast = reread.gains(generator, cache, 0, prompt[at:], 0, at, 4, decoder)
    assert torch.equal(slow, fast) and int(slow.sum()) > 0
    assert decoder.cache.batch_size == 0 and same(state(cache, 0), before)
    decoder.cache.add_rows(1)
    with pytest.raises(ValueError, match="no rows"):
        reread.gains(generator, cache, 0, prompt[at:], 0, at, 4, decoder)


def test_the_look_scores_the_windows_its_later_steps_gain_over_the_tail_and_its_first_step(peaked_model):
    """A position scores, summed over the look's steps after its first, the windows holding it beyond the
    most that held it after the tail alone or at the first step: what a decode step's choice holds
    before the reply has said anything is not what the reply points at."""
    generator = Generator(peaked_model, ByteTokenizer(), config(recall_reread_look=5, recall_reread_dense=0))
    prompt = tokens(120, 10)
    cache = generator.new_cache(1)
    at = generator.probe_start(prompt, cache.config)
    generator._prefill(cache, [prompt[:at]], ahead=True)
    ours = reread.gains(generator, cache, 0, prompt[at:], 0, at, 5)

    twin = cache.copy(0)
    logits = generator._prefill(twin, [prompt[at:]])[0]
    held = [reread.held_counts(twin, 0, at)]
    for _ in range(5):
        logits = generator.step(twin, [[int(logits.argmax())]])[0]
        held.append(reread.held_counts(twin, 0, at))
    floor = torch.maximum(held[0], held[1])
    expected = sum((h - floor).clamp(min=0) for h in held[2:])
    assert torch.equal(ours, expected) and int(ours.sum()) > 0
    assert not ours[floor >= torch.stack(held[2:]).max(0).values].any()  # held as much at the first step: nothing
    over_tail = sum((h - held[0]).clamp(min=0) for h in held[1:])  # every step against the tail alone
    assert not torch.equal(ours, over_tail)  # the first step's choice made a difference here


def test_the_text_must_cover_the_turn(peaked_model):
    generator = Generator(peaked_model, ByteTokenizer(), config())
    cache = generator.new_cache(1)
    body = tokens(80, 9)
    generator._prefill(cache, [body], ahead=True)
    with pytest.raises(ValueError, match="covers 79 positions"):
        reread.excerpt(generator, cache, 0, body[1:], 0, [5, 6], [10])


@pytest.mark.parametrize("field, value", [("recall_reread", -1), ("recall_reread_look", 1), ("recall_reread_dense", -1)])
def test_bad_re_read_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        config(**{field: value})


def test_a_turn_fed_in_two_calls_is_re_read_over_both_pieces(peaked_model):
    """`prefill(before=...)`: the turn began with tokens fed already; passages may come from them too."""
    generator = Generator(peaked_model, ByteTokenizer(), config())
    prompt = tokens(120, 10)
    prefix, piece = prompt[:60], prompt[60:]
    cache = generator.new_cache(1)
    generator._prefill(cache, [prefix], ahead=True)
    logits = generator.prefill(cache, [piece], recall=True, before=[prefix])[0]

    by_hand = generator.new_cache(1)
    generator._prefill(by_hand, [prefix], ahead=True)
    at = generator.probe_start(piece, by_hand.config)
    generator._prefill(by_hand, [piece[:at]], ahead=True)
    again = generator.reread(by_hand, 0, prefix + piece[:at], 0, piece[at:])
    assert again
    generator._prefill(by_hand, [again], ahead=True)
    assert torch.equal(logits, generator._prefill(by_hand, [piece[at:]])[0])
    assert cache.seen[0] == len(prompt) + len(again) and same(state(cache, 0), state(by_hand, 0))


def body_fed(generator, prompt: list[int]):
    """A 1-row cache fed the body of `prompt` (before its probe), and the tail."""
    cache = generator.new_cache(1)
    at = generator.probe_start(prompt, cache.config)
    generator._prefill(cache, [prompt[:at]], ahead=True)
    return cache, prompt[at:]


def test_a_dense_row_holds_every_token_once_in_the_order_of_the_text(peaked_model):
    """Its own slots and its archive, not the window's copies: each head's tokens, at their places."""
    generator = Generator(peaked_model, ByteTokenizer(), config())
    cache, _ = body_fed(generator, tokens(120, 11))
    n, r = cache.lengths[0], cache.recalled[0]
    assert len(cache.archives[0]) > 0 and r > 0
    dense, origins, archived = reread.dense_row(cache, 0, 1000, 9)
    seen = cache.seen[0]
    assert dense.lengths == [seen] and dense.seen == [seen] and dense.recalled == [0]
    assert torch.equal(origins, torch.arange(seen).expand_as(origins))
    assert torch.equal(dense.buffers().origins[:, 0, :, :seen], origins)
    own = cache.buffers().origins[:, 0, :, r:n]
    for layer, head in ((0, 0), (1, 1)):
        resident = set(own[layer, head].tolist())
        assert [not bool(a) for a in archived[layer, head]] == [t in resident for t in range(seen)]
        # a resident token's key as fed, as the row holds it; an archived one's as the archive does
        slot = own[layer, head].tolist().index(int(origins[layer, head, -1]))
        assert torch.equal(dense.buffers().keys[layer, 0, head, seen - 1], cache.buffers().keys[layer, 0, head, r + slot])
    cos, sin = generator.spec.rope.get(seen)
    assert torch.allclose(dense.buffers().rotated[:, 0, :, :seen], rotate(dense.buffers().keys[:, 0, :, :seen], cos, sin), atol=1e-5)
    assert dense.config.budget == seen + 9 and not dense.config.recalls  # room for 9 more before an eviction
    newest, origins, _ = reread.dense_row(cache, 0, 50, 9)
    assert newest.lengths == [50] and torch.equal(origins, torch.arange(seen - 50, seen).expand_as(origins))


def test_a_dense_row_fills_the_empty_cache_it_is_given_in_place(peaked_model):
    """Into a fast decoder's own cache (the look's steps), with nothing built to be copied there: the same
    row as a new cache's, in the storage the decoder reads; a cache that cannot take it is refused."""
    generator = Generator(peaked_model, ByteTokenizer(), config())
    cache, _ = body_fed(generator, tokens(120, 11))
    size = reread.dense_size(cache, 0, 1000)
    assert size == cache.seen[0]  # every token once: its own slots and its archive
    assert reread.dense_size(cache, 0, 50) == 50
    own, origins, archived = reread.dense_row(cache, 0, 1000, 9)
    dense_config = reread.dense_config(generator.config, size + 9)
    decoder = StaticDecoder(peaked_model, dense_config, 1)
    storage = [t.data_ptr() for t in decoder.cache._buffers()]
    into, into_origins, into_archived = reread.dense_row(cache, 0, 1000, 9, decoder.cache)
    assert into is decoder.cache and [t.data_ptr() for t in into._buffers()] == storage
    assert torch.equal(into_origins, origins) and torch.equal(into_archived, archived)
    assert into.lengths == own.lengths and into.seen == own.seen
    for mine, theirs in zip(into._buffers(), own._buffers()):
        assert torch.equal(mine[:, :1, :, :size], theirs[:, :1, :, :size])
    for wrong in (decoder.cache, StaticDecoder(peaked_model, replace(dense_config, budget=size), 1).cache):
        with pytest.raises(ValueError, match="empty cache"):
            reread.dense_row(cache, 0, 1000, 9, wrong)


def test_a_dense_row_decodes_as_the_row_where_nothing_was_evicted(peaked_model):
    """Where the budget holds the whole text, the dense row is the row: the same logits for the same tokens."""
    generator = Generator(peaked_model, ByteTokenizer(), config(budget=160))
    cache = generator.new_cache(1)
    generator._prefill(cache, [tokens(100, 12)])
    dense, _, archived = reread.dense_row(cache, 0, 1000, 9)
    assert not archived.any()
    for extra in ([5], [7, 9, 11]):
        assert torch.allclose(generator.step(dense, [extra])[0], generator.step(cache, [extra])[0], atol=1e-5)


def test_the_dense_look_gains_what_later_steps_attend_to_beyond_twice_the_first_where_a_head_archived_it(peaked_model):
    generator = Generator(peaked_model, ByteTokenizer(), config(recall_reread_look=5))
    cache, tail = body_fed(generator, tokens(120, 13))
    start, end = 0, cache.seen[0]
    before = state(cache, 0)
    ours = reread.gains(generator, cache, 0, tail, start, end, 5)
    assert same(state(cache, 0), before)  # the row is as it was

    dense, origins, archived = reread.dense_row(cache, 0, 1000, len(tail) + 6)
    n = origins.shape[2]
    logits = generator._prefill(dense, [tail])[0]
    drawn = []
    for _ in range(5):
        scores = dense.buffers().scores[:, 0, :, :n].clone()
        logits = generator.step(dense, [[int(logits.argmax())]])[0]
        drawn.append(dense.buffers().scores[:, 0, :, :n] - scores)
    per_slot = sum((d - reread.FIRST_TIMES * drawn[0]).clamp(min=0) for d in drawn[1:]) * archived
    expected = torch.zeros(end - start, dtype=torch.float64).index_add_(0, origins.flatten(), per_slot.flatten().double())
    expected[expected < reread.KEEP_SHARE * expected.max()] = 0
    assert torch.allclose(ours, expected) and ours.max() > 0
    resident_everywhere = ~archived.any(dim=1).any(dim=0)  # [n] in the order of the text, as origins
    assert not ours[resident_everywhere].any()  # what every head holds is read anyway: nothing to re-read
    assert 0 < int((ours > 0).sum()) < end - start


def test_the_look_is_dense_only_where_the_model_s_positions_hold_it(peaked_model, monkeypatch):
    """With recall_reread_dense 0, or no room left in the model's positions, the look reads through the windows."""
    dense_calls = []
    dense_row = reread.dense_row
    monkeypatch.setattr(reread, "dense_row", lambda *args: dense_calls.append(args[2]) or dense_row(*args))
    for settings, dense in ((dict(), True), (dict(recall_reread_dense=0), False), (dict(recall_reread_dense=10), False)):
        generator = Generator(peaked_model, ByteTokenizer(), config(**settings))
        cache, tail = body_fed(generator, tokens(120, 14))
        gains = reread.gains(generator, cache, 0, tail, 0, cache.seen[0], 4)
        assert (gains.dtype == torch.float64) == dense and bool(dense_calls) == dense
        dense_calls.clear()
    generator = Generator(peaked_model, ByteTokenizer(), config(recall_reread_dense=100))
    cache, tail = body_fed(generator, tokens(120, 14))
    reread.gains(generator, cache, 0, tail, 0, cache.seen[0], 4)
    assert dense_calls == [100 - len(tail) - 5]  # the newest that fit with the tail and the look
    positions = peaked_model.config.max_position_embeddings
    generator = Generator(peaked_model, ByteTokenizer(), config(recall_reread_dense=10 * positions))
    cache, tail = body_fed(generator, tokens(120, 14))
    dense_calls.clear()
    reread.gains(generator, cache, 0, tail, 0, cache.seen[0], 4)
    assert dense_calls == [positions - len(tail) - 5]


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a plain chat template: "<role>text\n" per message, "<assistant>" to reply."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text)


def test_the_excerpt_goes_after_the_question_before_the_end_of_the_user_s_turn(peaked_model):
    tokenizer = ChatBytes()
    generator = Generator(peaked_model, tokenizer, config(recall_probe=24))  # the question and the turn's end
    end = tokenizer.encode("\n<assistant>")
    assert generator.turn_end() == end and Generator(peaked_model, ByteTokenizer(), config()).turn_end() == []
    assert Generator(peaked_model, ByteTokenizer(), config(), turn_end=[7, 8]).turn_end() == [7, 8]
    prompt = generator.encode_chat([{"role": "user", "content": bytes(t % 90 + 32 for t in tokens(140, 15)).decode()
                                                                  + " what was it?"}])
    cache = generator.new_cache(1)
    ours = generator.prefill(cache, [prompt], recall=True)[0]

    by_hand, tail = body_fed(generator, prompt)
    body = prompt[:len(prompt) - len(tail)]
    again = generator.reread(by_hand, 0, body, 0, tail)
    at = generator.reread_at(tail)
    assert again and at == len(tail) - len(end) and tail[at:] == end
    logits = generator._prefill(by_hand, [[*tail[:at], *again, *tail[at:]]])[0]
    assert torch.equal(ours, logits) and same(state(cache, 0), state(by_hand, 0))
    assert generator.reread_at(tail[:-1]) == 0 and generator.reread_at(end) == 0  # not the turn's end: before the tail


def test_the_dense_look_on_a_static_decoder_gains_as_on_the_generator(peaked_model):
    """Its steps on a fast decoder of its own (reading the given decoder's matrices), the given one left empty."""
    generator = Generator(peaked_model, ByteTokenizer(), config())
    cache, tail = body_fed(generator, tokens(120, 16))
    slow = reread.gains(generator, cache, 0, tail, 0, cache.seen[0], 4)
    decoder = StaticDecoder(peaked_model, generator.config, 1)
    fast = reread.gains(generator, cache, 0, tail, 0, cache.seen[0], 4, decoder)
    assert torch.allclose(slow, fast, rtol=1e-4, atol=1e-6) and slow.max() > 0 and decoder.cache.batch_size == 0


def test_a_passage_runs_on_to_the_end_of_its_sentence_within_a_few_tokens():
    """A passage cut inside a number would put the cut number last before the answer."""
    text = list(b"The key is 60494. Remember it. 60494 it is.\nNext line here")
    ends = lambda token: chr(token) in ".!?\n"  # noqa: E731
    cut = text.index(ord("R")) + 13  # inside the second "60494"
    [(a, b)] = reread.finished([(4, cut)], text, ends)
    assert a == 4 and bytes(text[a:b]).endswith(b"60494 it is.")
    assert reread.finished([(4, cut)], text, ends, most=3) == [(4, cut)]  # no end within reach: as it was
    # runs that come to touch are merged; a span that ends a sentence already stays
    assert reread.finished([(0, 5), (8, 12)], text, ends) == [(0, text.index(ord(".")) + 1)]
    assert reread.finished([(0, text.index(ord(".")) + 1)], text, ends) == [(0, text.index(ord(".")) + 1)]
    # reaching back: to just after the last end before the start within reach, or to the text's start
    remember = text.index(ord("R"))
    assert reread.finished([(remember + 3, cut)], text, ends, back=8)[0][0] == remember - 1  # after ". "
    assert reread.finished([(remember + 3, cut)], text, ends, back=3)[0][0] == remember + 3  # out of reach
    assert reread.finished([(3, 6)], text, ends, back=5)[0][0] == 0
    assert reread.finished([(3, 6)], text, ends, back=2)[0][0] == 3


def test_a_generator_s_sentence_ends_are_the_ids_whose_text_holds_a_stop(peaked_model):
    tokenizer = ByteTokenizer()
    generator = Generator(peaked_model, tokenizer, config())
    ends = generator.sentence_ends()
    assert ends == {tokenizer.encode(stop)[0] for stop in reread.STOPS} and generator.sentence_ends() is ends
