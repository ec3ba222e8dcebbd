"""`find_bad_utf8(descriptor, data)`: the path of the first string field whose bytes are not UTF-8.

protobuf refuses to parse such a message as a whole ("String field had bad UTF-8"); this walks the
wire format with the message's descriptor so the client's error can name the field
(e.g. `messages.messages[1].content`).
"""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def find_bad_utf8(descriptor, data: bytes, prefix: str = "") -> str | None:
    """Field path of the first invalid UTF-8 string in `data` (a serialized `descriptor` message)."""
    counts: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = read_varint(data, pos)
            continue
        if wire == 1:
            pos += 8
            continue
        if wire == 5:
            pos += 4
            continue
        if wire != 2:
            raise ValueError(f"unsupported wire type {wire}")
        size, pos = read_varint(data, pos)
        chunk, pos = data[pos:pos + size], pos + size
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        index = counts.get(number, 0)
        counts[number] = index + 1
        repeated = field.is_repeated
        path = f"{prefix}{field.name}" + (f"[{index}]" if repeated else "")
        if field.type == _STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == _MESSAGE:
            found = find_bad_utf8(field.message_type, chunk, path + ".")
            if found:
                return found
    return None
