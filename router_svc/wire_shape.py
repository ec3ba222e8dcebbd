"""`check_wire_shape(data, limits)`: refuses a serialized GenerateRequest with more repeated entries
than any valid request has, before protobuf parses it.

Parsing builds an object per entry: a few bytes on the wire per empty stop string, token id, chat
message or tool call become tens of bytes each in memory (docs/architecture.md, "Failure model and
limits"), and the router would then walk them in Python. This walks the wire format instead and stops
as soon as a count is over its limit, so the cost is bounded by the limits, not by the message. A
malformed message is left to the parser, which reports it.
"""
from __future__ import annotations

from dataclasses import dataclass

from moemesh.errors import invalid, out_of_range
from router_svc.utf8 import read_varint

# GenerateRequest field numbers
MESSAGES, STOP, STOP_TOKEN_IDS, TOOLS, TEMPLATE_KWARGS = 5, 11, 12, 16, 17
TOOL_CALLS = 3  # ChatMessage.tool_calls
MAX_VARINT_BYTES = 10
MAX_OTHER_ENTRIES = 64  # entries of the singular fields (20 of them) and unknown ones
ENTRIES_PER_MESSAGE = 16  # the fields of a chat message, on average over a request, tool calls included


@dataclass(frozen=True)
class WireLimits:
    max_messages: int
    max_stops: int
    max_stop_token_ids: int
    max_tools: int
    max_template_kwargs: int
    max_tool_calls: int  # per message


def _entries(data: bytes, pos: int, end: int):
    """(field number, (start, end) of a length-delimited payload or None) for each entry of
    data[pos:end]; ValueError when it is not wire format."""
    while pos < end:
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = read_varint(data, pos)
            yield number, None
        elif wire == 2:
            size, pos = read_varint(data, pos)
            yield number, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            yield number, None
        else:
            raise ValueError(f"wire type {wire}")


def check_wire_shape(data: bytes, limits: WireLimits) -> None:
    """Raises MeshError naming the field when `data` holds more entries of a repeated field than
    `limits` allow."""
    counts = {STOP: 0, STOP_TOKEN_IDS: 0, TOOLS: 0, TEMPLATE_KWARGS: 0}
    caps = {STOP: (limits.max_stops, "stop"), STOP_TOKEN_IDS: (limits.max_stop_token_ids, "stop_token_ids"),
            TOOLS: (limits.max_tools, "tools"), TEMPLATE_KWARGS: (limits.max_template_kwargs, "chat_template_kwargs")}
    others = 0
    try:
        for number, payload in _entries(data, 0, len(data)):
            if number == STOP_TOKEN_IDS and payload is not None:  # packed: a blob of at least len/10 ids
                counts[number] += -(-(payload[1] - payload[0]) // MAX_VARINT_BYTES)
            elif number in counts:
                counts[number] += 1
            else:
                others += 1
                if number == MESSAGES and payload is not None:
                    _check_messages(data, payload, limits)
            if number in caps and counts[number] > caps[number][0]:
                raise invalid(f"{caps[number][1]}: at most {caps[number][0]}, got more")
            if others > MAX_OTHER_ENTRIES:
                raise invalid(f"request: more than {MAX_OTHER_ENTRIES} entries of its singular fields")
    except ValueError:  # not wire format: the parser says so
        return


def _check_messages(data: bytes, span: tuple[int, int], limits: WireLimits) -> None:
    budget = ENTRIES_PER_MESSAGE * limits.max_messages  # every entry inside, a message's own fields included
    n = 0
    for i, (_, message) in enumerate(_entries(data, *span)):
        if i >= limits.max_messages:
            raise out_of_range(f"messages: at most {limits.max_messages} messages (one per token of the context), got more")
        if message is None:
            continue
        calls = 0
        for number, _ in _entries(data, *message):
            n += 1
            calls += number == TOOL_CALLS
            if calls > limits.max_tool_calls:
                raise invalid(f"messages[{i}].tool_calls: at most {limits.max_tool_calls}, got more")
            if n > budget:
                raise out_of_range(f"messages: more than {budget} fields in all (at most {ENTRIES_PER_MESSAGE} per message on average)")

