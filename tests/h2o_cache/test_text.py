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
