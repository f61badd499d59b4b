"""The base of every request body: strict about its fields."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A body with a field this server does not know is refused (400 `unsupported_parameter` naming
    it), never silently ignored: a client relying on that field should hear so."""

    model_config = ConfigDict(extra="forbid")
