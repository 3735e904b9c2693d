r"""Refusing request strings that are no Unicode text.

JSON may spell a lone UTF-16 surrogate ("\ud800"); Python decodes it to a str that cannot be
encoded as UTF-8, so no tokenizer, template or log line can take it. Any such string in a
request body is the client's error: a 400 naming where it is.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from understudy.config import is_unicode_text
from understudy.server.protocol import APIError


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `value` (dicts, lists,
    strings; keys included) that holds a lone surrogate, or None."""
    if isinstance(value, str):
        return None if is_unicode_text(value) else path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not is_unicode_text(key):
                return path or "body"
            found = lone_surrogate_at(item, inner)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def refuse_lone_surrogates(body: BaseModel) -> None:
    """Raise a 400 naming the first field whose text holds a lone surrogate."""
    param = lone_surrogate_at(body.model_dump(exclude_unset=True, by_alias=True))
    if param is not None:
        raise APIError(
            400,
            f"{param} holds a lone surrogate (such as \\ud800): that is no Unicode text",
            param,
        )
