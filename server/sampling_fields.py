"""What the chat and the text completion requests share: streaming and the fields that shape sampling."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator
from pydantic_core import PydanticCustomError

from h2o_cache import SamplingParams
from server.body import Strict
from server.errors import APIError


def _list_of_stops(stop):
    return [stop] if isinstance(stop, str) else [] if stop is None else stop


Stop = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_list_of_stops), Field(max_length=4)]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against side channels; there is none to pad here


class SamplingRequest(Strict):
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator accepts
    stop: Stop = []
    n: int | None = 1
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=1024)
    user: str | None = None  # an end-user id for abuse monitoring: accepted, changes nothing

    # ----- server extras, not in the OpenAI API (vLLM's names) ----------------------------------------
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0: no limit")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the likeliest")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="divide the logits of tokens the "
                                      "conversation already holds by this (multiply when negative); 1: off")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field([], max_length=64,
                                                              description="token ids that end the reply")
    ignore_eos: bool = Field(False, description="generate exactly max_tokens (benchmarks)")
    min_tokens: int = Field(0, ge=0, description="the reply does not end (EOS, stop_token_ids) before this many "
                            "tokens: those tokens are not sampled until then; stop strings still end it")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise PydanticCustomError("unsupported", "only n=1 is supported")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token in bias or ():
            if not (token.isascii() and token.isdigit()):
                raise PydanticCustomError("token_id", "logit_bias keys are token ids, as strings of digits")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, max_fields: tuple[str, ...], default_max_tokens: int, max_tokens_limit: int,
               logprobs: int | None) -> SamplingParams:
        """The first of `max_fields` that is set (else the server default, capped by the limit).

        A request asking for more than the server's limit is refused (400 naming the field and the
        limit), never silently capped: a client that waits for 10**12 tokens should hear so at once.
        """
        for field in max_fields:
            asked = getattr(self, field)
            if asked is not None and asked > max_tokens_limit:
                raise APIError(400, f"{field} is {asked}, more than this server's limit of {max_tokens_limit} "
                                    f"tokens per reply", param=field, code="max_tokens_exceeded")
        source = next((f for f in max_fields if getattr(self, f)), None)
        asked = getattr(self, source) if source else default_max_tokens
        longest = min(asked, max_tokens_limit)
        if self.min_tokens > longest:
            raise APIError(400, f"min_tokens is {self.min_tokens}, more than the reply's {longest} tokens at most "
                                f"({source or 'the server default'})", param="min_tokens", code="invalid_value")
        return SamplingParams(
            max_new_tokens=longest,
            min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
            logprobs=logprobs,
        )
