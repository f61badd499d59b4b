"""HTTP body of GET /v1/sessions/{session_id}/cache: which tokens each layer and KV head still holds."""

from __future__ import annotations

from pydantic import BaseModel, Field

from server.engine import CacheView


class HeadCache(BaseModel):
    positions: list[int] = Field(description="positions in the conversation of the tokens this KV head holds, "
                                             "ascending (0 is the conversation's first token)")
    scores: list[float] | None = Field(description="accumulated attention of each held token (4 decimals); "
                                                   "null for policies that do not score")
    recalled: list[int] = Field(description="those of `positions` the last turn recalled from the session's archive "
                                            "of evicted tokens, held on top of the budget until the next turn")


class TurnSize(BaseModel):
    conversation_tokens: int = Field(description="tokens the session had consumed after the turn")
    resident_tokens: int = Field(description="tokens its cache held per layer and KV head")


class SessionCache(BaseModel):
    """A session's KV cache. Each head's first `kept_sinks` positions are attention sinks and its last
    `kept_recent` the recent window (both always kept); the others are heavy hitters, kept for their
    accumulated attention, or recalled (`recalled`). Every other position of the conversation has been evicted
    from that head; with recall (`--recall-budget`), evicted tokens wait in the session's archive."""

    session_id: str
    live: bool = Field(description="true: read during a reply, from the request in flight; "
                                   "false: as the last completed turn left it")
    conversation_tokens: int = Field(description="tokens the session has consumed (the conversation so far)")
    resident_tokens: int = Field(description="tokens each layer and KV head holds (the same count in all)")
    recalled_tokens: int = Field(description="of those, tokens the last turn recalled (0 without recall)")
    archived_tokens: int = Field(description="evicted tokens each layer and KV head keeps in the session's archive, "
                                             "which a later turn may recall (0 without recall)")
    kept_sinks: int
    kept_recent: int
    first_position: int = Field(description="position of tokens[0]")
    tokens: list[str] = Field(description="text of each token from first_position to the end of the "
                                          "conversation (the last `last` tokens)")
    layers: list[list[HeadCache]] = Field(description="[layer][kv_head]; empty when the session holds no cache")
    turns: list[TurnSize] = Field(description="sizes after each completed turn, oldest first")

    @classmethod
    def of(cls, view: CacheView) -> SessionCache:
        kept = view.kept
        layers = [] if kept is None else [
            [HeadCache(positions=h.positions, scores=None if h.scores is None else [round(s, 4) for s in h.scores],
                       recalled=h.recalled)
             for h in heads]
            for heads in kept.heads
        ]
        return cls(
            session_id=view.session_id, live=view.live, conversation_tokens=view.conversation_tokens,
            resident_tokens=kept.length if kept else 0, recalled_tokens=kept.recalled if kept else 0,
            archived_tokens=kept.archived if kept else 0, kept_sinks=kept.sinks if kept else 0,
            kept_recent=kept.recent if kept else 0, first_position=view.first_position, tokens=view.tokens,
            layers=layers, turns=[TurnSize(conversation_tokens=c, resident_tokens=r) for c, r in view.turns],
        )
