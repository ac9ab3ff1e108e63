"""The base of every request body and nested request object: refuses undeclared fields and lone
surrogates with a 400 naming them (see serve/protocol.py). Its own module so that the structured-
output and tool models, which protocol.py imports, can derive from it too."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(value: Any) -> Optional[str]:
    """Dotted path of a string (key or value) in a JSON value that is not valid Unicode text, or
    None. Iterative: any nesting depth the JSON parser took is walked without recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return path or "body"
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            if isinstance(key, str) and not _is_text(key):
                return path or "body"
            stack.append((f"{path}.{key}" if path else str(key), child))
    return None


def field_error(param: str, template: str) -> PydanticCustomError:
    """A validation error whose ctx names the field, for the 400's `param`; {param} in template
    is replaced by it (never format user input into the template itself)."""
    return PydanticCustomError("invalid_field", template, {"param": param})


class APIModel(BaseModel):
    """Base of request bodies: refuses undeclared fields and lone surrogates, naming them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise field_error(path, "`{param}` holds a lone UTF-16 surrogate, which is not valid Unicode text")
        return data

    @model_validator(mode="after")
    def _refuse_undeclared_fields(self) -> "APIModel":
        for name, value in (self.model_extra or {}).items():
            if value is not None:
                raise field_error(name, "`{param}` is not supported by this server")
        return self
