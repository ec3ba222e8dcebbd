"""Reading a request's JSON body and its fields, each error a 400 that names the field.

    obj = await read_json(request, max_bytes)
    f = Fields(obj)
    f.str("model", default="")            # absent or null -> default
    f.int("max_tokens", required=True)    # a bool is not an int
    f.number("temperature")               # int or float
    f.sub("stream_options")               # a nested object as Fields (empty when absent)
"""
from __future__ import annotations

import json
import math
from typing import Any

from gateway_svc.errors import ApiError, bad_request

MISSING = object()


async def read_json(request, max_bytes: int) -> dict:
    """The body as a JSON object: 413 beyond `max_bytes`, 400 when it is not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request: the body is {declared} bytes, more than the {max_bytes} accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request: the body is more than the {max_bytes} bytes accepted")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("request: the body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request: the body is not UTF-8 ({exc})") from exc
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise bad_request(f"request: the body is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise bad_request(f"request: the body must be a JSON object, got {type(obj).__name__}")
    return obj


def type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


class Fields:
    """Typed access to a JSON object's fields; `path` prefixes field names in errors."""

    def __init__(self, obj: dict, path: str = "") -> None:
        self.obj = obj
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def _get(self, key: str, required: bool):
        value = self.obj.get(key)
        if value is None:
            if required:
                raise bad_request(f"{self.name(key)}: required", self.name(key))
            return MISSING
        return value

    def _wrong(self, key: str, want: str, value: Any) -> ApiError:
        return bad_request(f"{self.name(key)}: must be {want}, got {type_name(value)}", self.name(key))

    def str(self, key: str, default: Any = None, required: bool = False, choices: tuple[str, ...] | None = None):
        value = self._get(key, required)
        if value is MISSING:
            return default
        if not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        if choices is not None and value not in choices:
            raise bad_request(f"{self.name(key)}: must be one of {', '.join(choices)}, got {value!r}", self.name(key))
        return value

    def bool(self, key: str, default: Any = None):
        value = self._get(key, False)
        if value is MISSING:
            return default
        if not isinstance(value, bool):
            raise self._wrong(key, "a boolean", value)
        return value

    def int(self, key: str, default: Any = None, required: bool = False, lo: int | None = None, hi: int | None = None):
        value = self._get(key, required)
        if value is MISSING:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer", value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad_request(f"{self.name(key)}: must be in [{lo}, {hi}], got {value}" if hi is not None
                              else f"{self.name(key)}: must be >= {lo}, got {value}", self.name(key))
        return value

    def number(self, key: str, default: Any = None):
        value = self._get(key, False)
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._wrong(key, "a finite number", value)
        return float(value)

    def list(self, key: str, required: bool = False) -> list:
        value = self._get(key, required)
        if value is MISSING:
            return []
        if not isinstance(value, list):
            raise self._wrong(key, "an array", value)
        return value

    def sub(self, key: str) -> "Fields":
        value = self._get(key, False)
        if value is MISSING:
            return Fields({}, self.name(key))
        if not isinstance(value, dict):
            raise self._wrong(key, "an object", value)
        return Fields(value, self.name(key))

    def raw(self, key: str, default: Any = None):
        value = self.obj.get(key)
        return default if value is None else value

    def item(self, key: str, index: int, value: Any) -> "Fields":
        """Element `index` of array `key`, which must be an object."""
        if not isinstance(value, dict):
            raise bad_request(f"{self.name(key)}[{index}]: must be an object, got {type_name(value)}", f"{self.name(key)}[{index}]")
        return Fields(value, f"{self.name(key)}[{index}]")

    def reject_nonzero(self, *keys: str) -> None:
        """Sampling options this server does not implement: 400 unless absent or neutral (0)."""
        for key in keys:
            value = self.obj.get(key)
            if value is not None and value != 0:
                raise bad_request(f"{self.name(key)}: not supported by this server (send 0 or leave it out)", self.name(key))
