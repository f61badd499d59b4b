from h2o_cache import StreamDecoder
from tests.conftest import ByteTokenizer


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
