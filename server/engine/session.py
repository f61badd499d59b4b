"""One conversation kept between requests: its messages and the 1-row KV cache that consumed them."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from h2o_cache import H2OCache


@dataclass(eq=False)  # identity: two sessions holding the same conversation are still two
class Session:
    """A conversation and its cache.

    `consumed_text` is exactly the text `cache` has consumed, its pending token included: the rendered
    prompt of the last turn followed by the decoded reply tokens; `token_ids` are those tokens, so the
    token at position p (a cache origin) is token_ids[p]. An int32 array: 4 bytes a token, about what
    the text itself takes. `reread` counts the tokens among them that the text does not hold: passages
    fed again after a question (`h2o_cache.reread`), left out of the prompt's token counts. A new turn
    reuses the cache only
    when the newly rendered conversation starts with this text (see `turn.plan_turn`).

    While `busy`, the request in flight takes `cache` once its prefill starts (None from then on)
    and the engine thread is the only writer of the fields below; otherwise the `SessionStore`
    lock guards them. `stats` reads `cache` unlocked, hence the single reads below.
    """

    id: str
    owner: str
    messages: list[dict] = field(default_factory=list)  # whole conversation, replies the server produced included
    cache: H2OCache | None = None  # None: nothing consumed yet (or reset after a failure)
    consumed_text: str = ""
    token_ids: array = field(default_factory=lambda: array("i"))
    reread: int = 0
    turns: list[tuple[int, int]] = field(default_factory=list)  # after each turn: (conversation, resident) tokens
    last_used: float = 0.0  # time.monotonic() seconds
    busy: bool = False
    ephemeral: bool = False  # a raw prompt's (text completions): never stored, never continued
    key: str | None = None  # its entry in the store's prefix index: conversation.conversation_keys(...)[-1]

    @property
    def resident_tokens(self) -> int:
        cache = self.cache  # once: the engine thread may take it meanwhile
        return cache.lengths[0] if cache is not None else 0

    @property
    def resident_bytes(self) -> int:
        cache = self.cache
        return cache.resident_bytes(0) if cache is not None else 0

    @property
    def archived_tokens(self) -> int:
        cache = self.cache
        return cache.archived_tokens(0) if cache is not None else 0

    @property
    def archived_bytes(self) -> int:
        cache = self.cache
        return cache.archived_bytes(0) if cache is not None else 0

    def reset(self) -> None:
        """Forget the cache (after a failed or interrupted prefill); the next turn prefills it all."""
        self.cache = None
        self.consumed_text = ""
        self.token_ids = array("i")
        self.reread = 0

