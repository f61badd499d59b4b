"""`response_format` (text, any JSON object, or a JSON schema) and the output grammar a request implies."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from server.body import Strict
from server.engine.grammar import GrammarError, output_grammar
from server.engine.tool_calls import Tools
from server.errors import APIError


class JSONSchema(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the reply follows the schema whatever this says: it is always enforced


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, json_schema, info: ValidationInfo):
        if (json_schema is None) == (info.data.get("type") == "json_schema"):
            raise PydanticCustomError("json_schema", 'json_schema goes with type "json_schema", and only with it')
        return json_schema

    @property
    def schema(self) -> dict | None:
        """The reply's JSON schema ({} for any JSON object), None for text."""
        if self.type == "text":
            return None
        return (self.json_schema.schema_ or {}) if self.json_schema is not None else {}


def grammar_of(response_format: ResponseFormat | None, tools: Tools | None) -> str | None:
    """The request's output grammar; a 400 naming `response_format` (or `tools`, for a function's
    parameters) when the grammar engine cannot compile it."""
    schema = response_format.schema if response_format is not None else None
    if schema is not None:
        try:
            output_grammar(schema, None)
        except GrammarError as error:
            raise APIError(400, f"the JSON schema does not compile: {error}", param="response_format",
                           code="invalid_schema") from error
    try:
        return output_grammar(schema, tools)
    except GrammarError as error:
        raise APIError(400, f"a function's parameters schema does not compile: {error}", param="tools",
                       code="invalid_schema") from error
