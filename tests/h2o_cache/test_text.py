import random

import pytest

from h2o_cache import StreamDecoder
from h2o_cache.text import byte_table
from tests.conftest import ByteTokenizer, shared_data


def stream(text, stop=()):
    tokenizer = ByteTokenizer(vocab=259)
    decoder = StreamDecoder(tokenizer, stop)
    pieces = [decoder.push(t) for t in tokenizer.encode(text)]
    return pieces, decoder


def test_multibyte_characters_are_never_split():
    pieces, decoder = stream("a€b😀")
    assert "".join(pieces) == "a€b😀"
    assert all("\ufffd" not in p for p in pieces)
    assert "€" in pieces and "😀" in pieces


def test_stop_string_is_cut_and_prefix_held_back_until_resolved():
    pieces, decoder = stream("hello END world", stop=("END",))
    assert "".join(pieces) == "hello " and decoder.stopped
    pieces, decoder = stream("an EN dash", stop=("END",))
    assert "".join(pieces) + decoder.flush() == "an EN dash" and not decoder.stopped


def test_tokenizers_that_are_not_byte_level_get_no_byte_table():
    assert byte_table(ByteTokenizer()) is None


@pytest.mark.model
def test_the_byte_table_streams_what_decode_gives_on_the_default_tokenizer(default_model):
    _, tokenizer = default_model
    table = byte_table(tokenizer)
    assert table is not None and len(table) == len(tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Café, naïve — 日本語 😀!\n  ok"}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    text = shared_data("botchan.txt").read_text()[:3000]
    rng = random.Random(0)
    for ids in (list(chat), tokenizer.encode(text), [rng.randrange(len(tokenizer)) for _ in range(3000)]):
        fast, slow = StreamDecoder(tokenizer, table=table), StreamDecoder(tokenizer)
        streamed = ["".join(d.push(t) for t in ids) + d.flush() for d in (fast, slow)]
        assert streamed[0] == streamed[1] == fast.text
        if not tokenizer.decode(ids, skip_special_tokens=True).endswith("\ufffd"):
            assert fast.text == tokenizer.decode(ids, skip_special_tokens=True)
    for stop in (("Paris",), ("日本",)):  # stop strings behave alike too
        ids = tokenizer.encode("The capital of France is Paris. 日本語")
        fast, slow = StreamDecoder(tokenizer, stop, table), StreamDecoder(tokenizer, stop)
        streamed = ["".join(d.push(t) for t in ids) for d in (fast, slow)]
        assert streamed[0] == streamed[1] == fast.text == slow.text
        assert fast.stopped and slow.stopped and stop[0] not in fast.text


def test_a_probe_starts_after_the_last_blank_line_within_its_tokens_or_at_its_length_from_the_end():
    from h2o_cache.text import line_breaks, probe_start
    tokenizer = ByteTokenizer(vocab=259)
    breaks = line_breaks(tokenizer)
    newline = tokenizer.encode("\n")[0]
    assert breaks[0] == breaks[1] == {newline} and not breaks[2]  # one byte a token: no token holds "\n\n"
    text = "a pasted document, line one.\nline two.\n\nWhat is the code?\n<assistant>"
    tokens = tokenizer.encode(text)
    question = text.index("\n\nWhat") + 2  # after the second newline, the one that makes the line blank
    assert probe_start(tokens, 64, breaks) == question
    assert probe_start(tokens, 64, None) == len(tokens) - 64  # the fixed tail, as before
    assert probe_start(tokens, 10, breaks) == len(tokens) - 10  # no blank line within the last 10
    assert probe_start(tokens, 1000, None) == 0 == probe_start(tokenizer.encode("no break"), 1000, breaks)
    # a blank line as the turn's last tokens still leaves the probe a token
    assert probe_start(tokenizer.encode("x\n\n"), 8, breaks) == 2
    # a token that holds the blank line and text after it starts the probe
    table = [b"", b"a", b"\n", b"\n\n", b"\n\n  ", b"?"]
    assert probe_start([1, 1, 3, 1, 5], 8, line_breaks(None, table)) == 3
    assert probe_start([1, 1, 4, 1, 5], 8, line_breaks(None, table)) == 2


def test_line_breaks_read_a_byte_table_where_there_is_one():
    from h2o_cache.text import line_breaks
    table = [b"", b"a", b"\n", b"b\n", b"\nc", b"\n\n", b"x\n\ny"]
    ends, starts, blank = line_breaks(None, table)
    assert ends == {2, 3, 5} and starts == {2, 4, 5} and blank == {5, 6}


def test_the_ids_holding_a_mark_come_from_the_byte_table_or_from_decoding_each_id():
    from h2o_cache.text import holding
    table = [b"", b"a.", b"b", b"?\n", b"c!", b"end"]
    assert holding(None, (".", "!", "\n"), table) == {1, 3, 4}
    assert holding(None, ("nd",), table) == {5}
    tokenizer = ByteTokenizer(vocab=259)
    assert holding(tokenizer, (".", "\n")) == {tokenizer.encode(".")[0], tokenizer.encode("\n")[0]}
