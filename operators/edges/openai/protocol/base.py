"""What every request model shares: strict scalar types, the base model, cross-field errors.

Apart so that the message and request modules can both build on it without importing each
other.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

__all__ = ("MAX_INT", "Bool", "Count", "Float", "Model", "Priority", "TokenId", "invalid")

#: the largest count or token id a request may give: engines hold them in 32-bit integers
#: (llama.cpp's ``llama_token`` and ``n_predict``), and a bound at the edge keeps a value
#: no engine can hold (``max_tokens: 2**63``) a 400 naming its field instead of a 500 deep
#: inside one
MAX_INT: Final = 2**31 - 1

# Integers and booleans are strict: JSON ``true`` is not a count, ``"yes"`` not a boolean.
Count = Annotated[int, Field(strict=True, ge=1, le=MAX_INT)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT)]
Float = Annotated[float, Field(allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
#: a request's scheduling priority (vLLM's ``priority``): lower runs earlier, 0 by default
#: (or the API key's); bounded both ways like every integer (:mod:`pipeline.priority`)
Priority = Annotated[int, Field(strict=True, ge=-MAX_INT, le=MAX_INT)]


class Model(BaseModel):
    """Unknown fields are ignored (other servers' ``extra_body`` extensions), not refused."""

    model_config = ConfigDict(extra="ignore", frozen=False, validate_assignment=False)


def invalid(param: str, message: str) -> PydanticCustomError:
    """An error for a rule across fields, carrying the field to blame."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})
