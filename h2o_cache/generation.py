"""Generation loop over an `H2OCache`: chunked prefill, batched decode, continuation of sequences.

transformers' `generate()` recomputes absolute positions from the sequence length, which undoes
position rolling, so this module drives the model itself. Every position the model sees comes
from the cache (`H2OCache.begin`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h2o_cache import reread
from h2o_cache.cache import H2OCache
from h2o_cache.config import CacheConfig
from h2o_cache.hf import forward, model_spec
from h2o_cache.sampling import Sample, Sampler, SamplingParams, sample
from h2o_cache.text import StreamDecoder, byte_table, holding, line_breaks, probe_start


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or stop string) or "length"
    logprobs: list[Sample] = field(default_factory=list)


def common_end(a: list[int], b: list[int]) -> list[int]:
    """The tokens two chats that differ only in one message's text end with alike: where they are
    rendered with the generation prompt, what a template puts after that message ([] where one of them
    ends with its text)."""
    common = 0
    while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
        common += 1
    return a[len(a) - common:] if common < min(len(a), len(b)) else []


class Generator:
    """Drives a Llama-family model with budgeted caches.

    A cache row is one sequence. The token sampled last in a row is not fed to the model until the
    row continues; `H2OCache.pending` keeps it, so `generate(new_prompts, cache=cache)` continues a
    conversation exactly as if the whole text had been fed at once.
    """

    def __init__(self, model, tokenizer, config: CacheConfig | None = None, turn_end: list[int] | None = None):
        """turn_end: what a chat template puts after a user's message when the reply follows (`turn_end`);
        by default found from the tokenizer's chat template."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or CacheConfig()
        self.spec = model_spec(model)
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
        self._byte_table: list[bytes] | None = None  # computed on first use: [] when the tokenizer has none
        self._breaks: tuple | None = None  # `line_breaks`, computed on first use
        self._sentence_ends: frozenset[int] | None = None  # `sentence_ends`, computed on first use
        self._separator: list[int] | None = None  # a blank line's tokens, between re-read passages
        self._turn_end = turn_end  # `turn_end`; None: computed on first use
        # a `StaticDecoder` of one row and this config (the fast step) for re-reads' looks; None: `step`
        self.looker = None

    def _bytes(self) -> list[bytes] | None:
        """The tokenizer's byte table (`text.byte_table`), computed on first use; None where it has none."""
        if self._byte_table is None:
            self._byte_table = byte_table(self.tokenizer) or []
        return self._byte_table or None

    def stream_decoder(self, stop: tuple[str, ...] = ()) -> StreamDecoder:
        """A detokenizer for one sequence (byte-table fast path when the tokenizer allows, see `text`)."""
        return StreamDecoder(self.tokenizer, stop, self._bytes())

    def probe_start(self, tokens, config: CacheConfig) -> int:
        """Where a turn's probe (`recall_probe`, `recall_probe_break`) starts in its prompt `tokens`."""
        if not config.recall_probe_break:
            return probe_start(tokens, config.recall_probe, None)
        if self._breaks is None:
            self._breaks = line_breaks(self.tokenizer, self._bytes())
        return probe_start(tokens, config.recall_probe, self._breaks)

    def sentence_ends(self) -> frozenset[int]:
        """The token ids whose text ends a sentence or a line (holds one of `reread.STOPS`): where a re-read
        passage may end (`reread.finished`)."""
        if self._sentence_ends is None:
            self._sentence_ends = holding(self.tokenizer, reread.STOPS, self._bytes())
        return self._sentence_ends

    def turn_end(self) -> list[int]:
        """The tokens the chat template puts after a user's message when the reply follows it (the end of
        the user's turn and the assistant's header; `common_end` of two one-message chats), as given to
        the constructor or found from the tokenizer's template; [] where it has none."""
        if self._turn_end is None:
            try:
                a, b = (self.encode_chat([{"role": "user", "content": text}]) for text in ("a", "b"))
            except Exception:  # no chat template: nothing is known of a turn's end
                a = b = []
            self._turn_end = common_end(a, b)
        return self._turn_end

    def reread_at(self, tail: list[int]) -> int:
        """Where in a turn's `tail` its re-read goes (`h2o_cache.reread`, step 3): before the chat
        template's end of the user's turn, after the question, where the tail ends with it; else 0,
        before the tail."""
        end = self.turn_end()
        return len(tail) - len(end) if end and len(tail) > len(end) and tail[-len(end):] == end else 0

    def new_cache(self, rows: int = 0, config: CacheConfig | None = None) -> H2OCache:
        return H2OCache(self.spec, config or self.config, rows)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        ))

    # ----- model passes ------------------------------------------------------------------

    def prefill(self, cache: H2OCache, tokens: list[list[int]], recall: bool = False,
                before: list[list[int]] | None = None) -> torch.Tensor:
        """Feed tokens[b] to row b, in chunks of at most `prefill_chunk` tokens per row.

        recall: tokens are a new turn's prompt; with a cache that recalls, its last `recall_probe`
        tokens (where the question usually is; with `recall_probe_break`, after the last blank line among
        them: `probe_start`) are fed as chunks of their own, so that their queries
        alone choose the recall window the reply starts with (with `recall_ahead`, the chunks before
        them take the window their previous chunk's queries chose: one choice per chunk, not one per
        layer); before them, where the body overflows the budget, the passages the reply will answer
        from are fed again (`recall_reread`, `h2o_cache.reread`). before[b]: tokens of row b's turn it
        was fed already (its turn began before tokens[b]), which passages may come from too.
        Returns fp32 logits after each row's last token [B, V]. Every row needs >= 1 token.
        """
        if any(not t for t in tokens):
            raise ValueError("every row needs at least one token to prefill")
        if recall and cache.config.recalls:
            starts = [self.probe_start(t, cache.config) for t in tokens]
            heads = [t[:at] for t, at in zip(tokens, starts)]
            before = before or [[] for _ in tokens]
            firsts = [seen - len(b) for seen, b in zip(cache.seen, before)]
            if any(heads):
                self._prefill(cache, heads, ahead=True)
            tokens = [t[at:] for t, at in zip(tokens, starts)]
            again = [self.reread(cache, row, [*b, *head], first, tail, self.looker)
                     for row, (b, head, first, tail) in enumerate(zip(before, heads, firsts, tokens))]
            inside = [self.reread_at(tail) if passages else 0 for tail, passages in zip(tokens, again)]
            if any(passages and not at for passages, at in zip(again, inside)):  # before the tail, as the body
                self._prefill(cache, [[] if at else passages for passages, at in zip(again, inside)], ahead=True)
            tokens = [[*tail[:at], *passages, *tail[at:]] if at else tail
                      for tail, passages, at in zip(tokens, again, inside)]
        return torch.stack(self._prefill(cache, tokens))

    def reread(self, cache: H2OCache, row: int, body, first: int, tail: list[int], decoder=None) -> list[int]:
        """What row `row` is fed again with `tail` (`h2o_cache.reread`, `reread_at`), its turn's `body` (the tokens
        it was fed from position `first` on) just fed; [] where the turn is not re-read. decoder: a
        `StaticDecoder` with no rows for the look's steps (else `step`; `looker` in `prefill`)."""
        if not reread.due(cache, len(body)):
            return []
        if self._separator is None:
            self._separator = self.tokenizer.encode("\n\n", add_special_tokens=False)
        return reread.excerpt(self, cache, row, body, first, tail, self._separator, decoder)

    def _prefill(self, cache: H2OCache, tokens: list[list[int]], ahead: bool = False) -> list[torch.Tensor | None]:
        """Logits after each row's last token; None for rows given no tokens. ahead: the tokens are a
        prompt's body (its chunks may take the window their previous chunk chose, `H2OCache.begin`)."""
        chunk = cache.config.prefill_chunk
        last: list[torch.Tensor | None] = [None] * len(tokens)
        for start in range(0, max(map(len, tokens)), chunk):
            pieces = [t[start:start + chunk] for t in tokens]
            logits = self.step(cache, pieces, [ahead] * len(pieces) if ahead else None)
            for b, piece in enumerate(pieces):
                if piece:
                    last[b] = logits[b]
                cache.expect(b, len(tokens[b]) - start - chunk)
        return last

    def step(self, cache: H2OCache, pieces: list[list[int]], ahead: list[bool] | None = None) -> torch.Tensor:
        """One forward pass: row b takes pieces[b] (may be empty); ahead[b]: pieces[b] is of a prompt's
        body, not its tail (`H2OCache.begin`). Returns last-token logits [B, V]."""
        return forward(self.model, cache, *self._padded(pieces), ahead=ahead)

    def _padded(self, pieces: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        width = max(map(len, pieces))
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([p + [pad] * (width - len(p)) for p in pieces], device=self.spec.device)
        return input_ids, [len(p) for p in pieces]

    # ----- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] = SamplingParams(),
        cache: H2OCache | None = None,
    ) -> list[Completion]:
        """Generate a completion for each prompt (token ids), one cache row per prompt.

        With `cache`, row b continues: its pending token and prompts[b] are appended to what it holds.
        """
        if cache is None:
            cache = self.new_cache(len(prompts))
        if cache.batch_size != len(prompts):
            raise ValueError(f"{len(prompts)} prompts for a cache of {cache.batch_size} rows")
        params = params if isinstance(params, list) else [params] * len(prompts)
        samplers = [Sampler(p, ends=self.eos_token_ids) for p in params]
        decoders = [self.stream_decoder(p.stop) for p in params]
        results = [Completion() for _ in prompts]
        logits = self.prefill(cache, [pending + list(p) for pending, p in zip(cache.pending, prompts)], recall=True)
        active = list(range(len(prompts)))
        while active:
            next_pieces: list[list[int]] = [[] for _ in prompts]
            samples = sample(logits[active], [samplers[b] for b in active])
            for b, drawn in zip(active, samples):
                results[b].token_ids.append(drawn.token)
                if params[b].logprobs is not None:
                    results[b].logprobs.append(drawn)
                cache.pending[b] = [drawn.token]
                _, done = consume(drawn.token, params[b], decoders[b], len(results[b].token_ids), self.eos_token_ids)
                if done:
                    results[b].finish_reason = done
                else:
                    next_pieces[b] = [drawn.token]
            active = [b for b in active if next_pieces[b]]
            if active:
                logits = self.step(cache, next_pieces)
        for result, decoder in zip(results, decoders):
            decoder.flush()
            result.text = decoder.text
        return results


def consume(token: int, params: SamplingParams, decoder: StreamDecoder, generated: int,
            eos_token_ids: set[int]) -> tuple[str | None, str | None]:
    """The stop rule: take the `generated`-th sampled token of a sequence.

    Returns the text it makes safe to stream (None for an end token, which shows no text) and the
    finish reason once the sequence is done: "stop" (EOS, a stop token id or a stop string) or
    "length" (max_new_tokens reached), else None.
    """
    if token in eos_token_ids and not params.ignore_eos or token in params.stop_token_ids:
        return None, "stop"
    text = decoder.push(token)
    if decoder.stopped:
        return text, "stop"
    if generated >= params.max_new_tokens:
        return text, "length"
    return text, None
