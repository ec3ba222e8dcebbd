"""`check_wire_shape(data, max_messages)`: refuses a serialized GenerateRequest with more repeated
entries than any valid request has, before protobuf parses it.

Parsing builds an object per entry: a few bytes on the wire per empty stop string, token id or chat
message become 16-60 bytes each in memory (9 MB of empty chat messages took 290 MB to parse), and
the router would then walk them in Python. This walks the wire format instead and stops as soon as a
count is over its limit, so the cost is bounded by the limits, not by the message. A malformed
message is left to the parser, which reports it.
"""
from __future__ import annotations

from moemesh.errors import invalid, out_of_range
from router_svc.utf8 import read_varint

MESSAGES, STOP, STOP_TOKEN_IDS = 5, 11, 12  # GenerateRequest field numbers
MAX_VARINT_BYTES = 10
MAX_OTHER_ENTRIES = 64  # entries of the singular fields (15 of them) and unknown ones


def check_wire_shape(data: bytes, max_messages: int, max_stops: int, max_stop_token_ids: int) -> None:
    """Raises MeshError naming the field when `data` holds more than `max_messages` chat messages,
    `max_stops` stop strings or `max_stop_token_ids` stop token ids."""
    counts = {STOP: 0, STOP_TOKEN_IDS: 0}
    others = 0
    try:
        pos = 0
        while pos < len(data):
            key, pos = read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = read_varint(data, pos)
                value = None
            elif wire == 2:
                size, pos = read_varint(data, pos)
                value, pos = (pos, pos + size), pos + size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
                value = None
            else:
                return  # not a valid message: the parser says so
            if number == STOP:
                counts[STOP] += 1
            elif number == STOP_TOKEN_IDS:
                # unpacked: one id per entry; packed: a blob of at least len/10 ids
                counts[STOP_TOKEN_IDS] += 1 if value is None else -(-(value[1] - value[0]) // MAX_VARINT_BYTES)
            else:
                others += 1
                if number == MESSAGES and value is not None:
                    _check_messages(data, value[0], value[1], max_messages)
            if others > MAX_OTHER_ENTRIES:
                raise invalid(f"request: more than {MAX_OTHER_ENTRIES} entries besides stop and stop_token_ids")
            if counts[STOP] > max_stops:
                raise invalid(f"stop: at most {max_stops} stop strings, got more")
            if counts[STOP_TOKEN_IDS] > max_stop_token_ids:
                raise invalid(f"stop_token_ids: at most {max_stop_token_ids}, got more")
    except ValueError:  # truncated varint: malformed, the parser reports it
        return


def _check_messages(data: bytes, pos: int, end: int, max_messages: int) -> None:
    n = 0
    while pos < end:
        key, pos = read_varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = read_varint(data, pos)
        elif wire == 2:
            size, pos = read_varint(data, pos)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return
        n += 1  # a message, or an unknown field: both cost as much to parse
        if n > max_messages:
            raise out_of_range(f"messages: at most {max_messages} messages (one per token of the context), got more")
