"""Constrained decoding: what a reply must match, as an llguidance grammar, and one matcher per sequence.

A request's grammar (`output_grammar`) comes from its `response_format` (a JSON schema, or any JSON
object) and its tools: a forced `tool_choice` ("required" or a named function) admits only
`<tool_call>` blocks whose JSON is a call of the allowed functions with arguments matching their
parameters schema; with "auto", a JSON `response_format` admits either its JSON or calls. Each
sequence under a grammar holds its own `llguidance.LLMatcher`; before sampling, the rows' token
bitmasks mask their logits (`constrain`), and every sampled token advances the row's matcher. A
matcher that can take no more tokens ends its sequence (finish reason "stop").

JSON is written compactly but with the separators models are used to (`", "` and `": "`): free
whitespace lets a small model pad forever.
"""

from __future__ import annotations

import json
import threading

import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from server.engine.tool_calls import CLOSE, OPEN, Tools

JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile; the message says why."""


def output_grammar(schema: dict | None, tools: Tools | None) -> str | None:
    """The grammar a reply must match, or None when it is free text.

    schema: the JSON schema of a JSON reply ({} for any JSON object), None for text.
    Raises GrammarError for a schema (or a function's parameters) that does not compile.
    """
    forced = tools is not None and tools.functions and tools.choice not in ("auto", "none")
    may_call = tools is not None and tools.functions and tools.choice == "auto"
    if not forced and schema is None:
        return None
    rules = []
    if forced:
        rules.append("start: calls")
    elif may_call:
        rules.append("start: answer | calls")
    else:
        rules.append("start: answer")
    if not forced:
        rules.append(f"answer: %json {_json_schema(schema or {'type': 'object'})}")
    if forced or may_call:
        functions = [f for f in tools.functions if tools.choice in ("auto", "required", f["name"])]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        rules.append('calls: call ("\\n" call)*' if tools.parallel else "calls: call")
        rules.append(f"call: {json.dumps(OPEN + chr(10))} %json {_json_schema(call)} {json.dumps(chr(10) + CLOSE)}")
    grammar = LLMatcher.grammar_from_lark("\n".join(rules) + "\n")
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0])
    return grammar


def _json_schema(schema: dict) -> str:
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


class Grammars:
    """Builds matchers for one tokenizer; the llguidance tokenizer is made on first use (about 0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: LLTokenizer | None = None
        self._lock = threading.Lock()

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher at the grammar's start. Raises GrammarError if it cannot be built."""
        matcher = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                if hasattr(self.tokenizer, "backend_tokenizer"):
                    self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
                else:
                    self._ll = LLTokenizer(TokenizerWrapper(_DecodedTokens(self.tokenizer, self.vocab_size)))
            return self._ll


class _DecodedTokens:
    """What llguidance needs of a tokenizer without a Rust backend: each token's bytes, decoded alone."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        texts = [tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(vocab_size)]
        self.special_token_ids = [i for i, text in enumerate(texts) if not text]
        self.tokens = [text or f"<[{i}]>".encode() for i, text in enumerate(texts)]

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)


def constrain(logits: torch.Tensor, matchers: list[LLMatcher | None]) -> torch.Tensor:
    """logits: [B, V] for the next token of each row; row b may only take what matchers[b] allows
    (unconstrained rows: None). Returns new logits: the step's own output buffer is left as it was.

    The bitmask is unpacked and applied with numpy on a CPU: one pass over [B, V] without waking
    torch's thread pool, which costs more than the work at this size when the cores are busy (1.5 ms
    against 8-30 ms at batch 8 on SmolLM2's 49k vocabulary, measured on our 2 loaded cores).
    """
    rows = [b for b, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = np.full((logits.shape[0], words), -1, dtype=np.int32)  # an unconstrained row allows every token
    for b in rows:  # the matchers' tokenizer has the logits' vocabulary (`Grammars`)
        # what llguidance.torch.fill_next_token_bitmask does, without importing torch.compile with it
        matchers[b].unsafe_compute_mask_ptr(bitmask[b].ctypes.data, words * 4)
    # allowed: [B, V], bit t % 32 of word t // 32 (little-endian words)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.where(allowed, logits.detach().numpy(), np.float32(-np.inf)))
    return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device, non_blocking=True), float("-inf"))
