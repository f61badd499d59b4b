import json
import math

from h2o_cache import CacheConfig, Generator
from h2o_cache.bench.xsum import MIN_BUDGET, Article, cache_config, evaluate, load_articles, table, targets
from tests.conftest import ByteTokenizer


class ChatByteTokenizer(ByteTokenizer):
    def apply_chat_template(self, messages, **kwargs):
        return self.encode(messages[-1]["content"])


def test_load_articles_keeps_file_order_within_the_length_range(tiny_model, tmp_path):
    path = tmp_path / "x.jsonl"
    docs = ["a" * 10, "b" * 200, "c" * 60, "d" * 120]  # each prompt adds the instruction's tokens
    path.write_text("".join(json.dumps({"document": d, "summary": d[:3]}) + "\n" for d in docs))
    gen = Generator(tiny_model, ChatByteTokenizer())
    articles = load_articles(gen, path, limit=5, min_tokens=100, max_tokens=190)
    assert [a.reference for a in articles] == ["ccc", "ddd"]


def test_budget_never_exceeds_the_fraction_of_the_shortest_prompt():
    for shortest in (200, 333, 1000):
        for fraction in (0.1, 0.2, 0.6):
            config = cache_config("h2o", fraction, shortest, 0.5)
            assert config.budget <= max(MIN_BUDGET, fraction * shortest)
            assert config.prefill_chunk <= config.budget // 4


def test_evaluate_scores_every_article_under_every_configuration(tiny_model, byte_tokenizer):
    gen = Generator(tiny_model, byte_tokenizer, CacheConfig())
    articles = [Article([3 + i % 120 for i in range(n)], "some words here") for n in (100, 140, 120)]
    fractions, policies = [0.2, 1.0], ["h2o", "local"]
    results = evaluate(gen, articles, fractions, policies, batch=2, max_new_tokens=4)
    assert set(results) == {("full", 1.0)} | {(p, f) for p in policies for f in fractions}
    for scores in results.values():
        assert len(scores.rouge2) == len(articles)
        assert all(math.isfinite(s) and 0 <= s <= 1 for s in scores.rouge2)
    assert max(results[("h2o", 0.2)].budget_share) <= 0.2
    lines = table(results, fractions, policies, "caption").splitlines()
    assert lines[2].startswith("| budget |") and len(lines) == 4 + len(fractions) + 1
    assert targets(results, fractions)[-1].startswith("- H2O >= local at every budget: ")
