from moemesh.rpc.protos import load
from router_svc.utf8 import find_bad_utf8

pb, _ = load("generation")


def replace_bytes(msg, good: bytes, bad: bytes) -> bytes:
    raw = msg.SerializeToString()
    assert raw.count(good) == 1
    return raw.replace(good, bad)


def test_names_the_top_level_field():
    raw = replace_bytes(pb.GenerateRequest(prompt="ab"), b"ab", b"\xff\xfe")
    assert find_bad_utf8(pb.GenerateRequest.DESCRIPTOR, raw) == "prompt"


def test_names_nested_and_repeated_fields():
    msg = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="ok"), pb.ChatMessage(role="user", content="zz")]),
        stop=["a"],
    )
    raw = replace_bytes(msg, b"zz", b"\xc3\x28")
    assert find_bad_utf8(pb.GenerateRequest.DESCRIPTOR, raw) == "messages.messages[1].content"


def test_valid_message_has_no_bad_field():
    raw = pb.GenerateRequest(prompt="héllo", stop=["x", "ü"], max_new_tokens=3).SerializeToString()
    assert find_bad_utf8(pb.GenerateRequest.DESCRIPTOR, raw) is None
