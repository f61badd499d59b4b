import pytest

from h2o_cache import Generator
from h2o_cache.bench.passkey import answer_tokens, cache_config, chat_prompt, recalled, secrets, single_prompt
from tests.conftest import ByteTokenizer


class TemplateTokenizer(ByteTokenizer):
    """Bytes, with a chat template that renders `role: content` lines."""

    def __init__(self):
        super().__init__(vocab=259)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


@pytest.fixture()
def gen(tiny_model):
    return Generator(tiny_model, TemplateTokenizer())


def test_secrets_are_distinct_and_reproducible():
    keys = secrets(20, fact=False, seed=1)
    assert keys == secrets(20, fact=False, seed=1) and len({k.answer for k in keys}) == 20
    assert all(len(k.answer.strip()) == 5 and k.answer.strip().isdigit() for k in keys)
    assert len({c.answer for c in secrets(20, fact=True)}) == 20


def test_the_needle_sits_at_its_depth_and_the_answer_follows_the_opening(gen):
    filler = [ord("#") + 3] * 200
    secret = secrets(1, fact=False)[0]
    needle = gen.tokenizer.encode(secret.needle)
    for depth in (0.0, 0.5, 0.9):
        prefix, item = single_prompt(gen, filler, secret, depth)
        assert prefix == single_prompt(gen, filler, secrets(2, fact=False, seed=5)[1], depth)[0]  # shared by all keys
        text = gen.tokenizer.decode(prefix + item.context)
        before_needle = text.index(secret.needle)
        xs_before = text[:before_needle].count("#")
        assert xs_before == int(depth * len(filler))
        assert text.endswith("assistant: The pass key is ")  # the lone space is forced, the digits asked
        assert gen.tokenizer.decode(item.target) == secret.answer.strip()
        assert len(prefix) + len(item.context) >= len(filler) + len(needle)


def test_chat_prompt_tells_first_and_asks_last(gen):
    secret = secrets(1, fact=True)[0]
    words = [f"w{i}" for i in range(100)]
    item = chat_prompt(gen, words, secret, turns=3, words_per_turn=10)
    text = gen.tokenizer.decode(item.context)
    assert text.index(secret.needle.strip()) < text.index("w0") < text.index("w29") < text.index(secret.question)
    assert "w30" not in text and text.count("Summarize it in one line.") == 3
    opening, answer = answer_tokens(gen, secret)
    assert item.context[-len(opening):] == opening and item.target == answer


def test_recalled_counts_items_greedy_decoding_reproduces(gen):
    secret = secrets(3, fact=False)
    probes = [single_prompt(gen, [50] * 40, s, 0.5) for s in secret]
    prefix, items = probes[0][0], [item for _, item in probes]
    hits = recalled(gen, cache_config("h2o:32"), prefix, items, batch=2)
    assert 0 <= hits <= 3
    assert cache_config("full").policy == "full" and cache_config("local:64").budget == 64
