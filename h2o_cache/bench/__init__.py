"""Evaluation programs for h2o_cache; each prints markdown tables measured in one run.

    python -m h2o_cache.bench.xsum        # ROUGE-2 of one-sentence XSum summaries vs. KV budget
    python -m h2o_cache.bench.perplexity  # streaming perplexity past the model's context window
    python -m h2o_cache.bench.speed       # decode-step cost of H2O bookkeeping vs. the full cache

Results and the commands that produced them: h2o_cache/bench/RESULTS.md.
"""
