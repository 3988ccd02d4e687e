"""The sandbox wire protocol: both ends use one description (klear.rewards.sandbox_protocol).

The zygote runs as a script outside the package and loads the protocol file by path; these tests
check that it loads the very same file, that frames are what the docstring says, and that the two
value codecs (trusted: klear.rewards.code.rpc, program side: the zygote's) speak exactly the
tags the protocol lists, in both directions.
"""

from __future__ import annotations

import decimal
import fractions
import json
import math
import os
from pathlib import Path

import pytest

from klear.rewards import sandbox_protocol as protocol
from klear.rewards.code.layouts import parse_ground_truth
from klear.rewards.code.rpc import Remote, _Codec
from klear.rewards.code.run import run_tests
from klear.rewards.sandbox import Sandbox, SandboxConfig, _zygote_module


@pytest.fixture(scope="module")
def zygote():
    return _zygote_module()


def test_zygote_loads_the_same_protocol_file(zygote):
    assert os.path.samefile(zygote.protocol.__file__, protocol.__file__)
    assert zygote.TAG == protocol.TAG == "$t"


@pytest.mark.parametrize("path", ["_sandbox_zygote.py", "sandbox.py", "code/rpc.py"])
def test_protocol_literals_are_written_only_in_the_protocol_module(path):
    src = (Path(protocol.__file__).parent / path).read_text()
    for literal in ('"$t"', '">I"', "'>I'", '"op": "', "1 << 53"):
        assert literal not in src, literal


def test_frame_layout_and_limits():
    body = {"op": protocol.OP_CALL, "args": [1, "é"]}
    data = protocol.frame(body)
    expected = json.dumps(body).encode()
    assert data[:4] == len(expected).to_bytes(4, "big") and data[4:] == expected
    assert protocol.frame_length(data[:4], protocol.MAX_REPLY_BYTES, "reply") == len(expected)
    assert protocol.frame_length((16 << 20).to_bytes(4, "big"), 16 << 20, "reply") == 16 << 20
    with pytest.raises(ValueError, match=r"reply of 16777217 bytes exceeds 16777216"):
        protocol.frame_length(((16 << 20) + 1).to_bytes(4, "big"), protocol.MAX_REPLY_BYTES, "reply")
    with pytest.raises(ValueError, match="not JSON compliant"):  # a program reply never carries a bare NaN
        protocol.frame({"v": float("nan")}, allow_nan=False)
    assert json.loads(protocol.frame({"v": float("inf")})[4:])["v"] == math.inf


@pytest.mark.parametrize(
    "v,expected",
    [
        (2**53 - 1, 2**53 - 1),
        (-(2**53) + 1, -(2**53) + 1),
        (2**53, {"$t": "int", "v": "0x20000000000000"}),
        (-(2**53), {"$t": "int", "v": "-0x20000000000000"}),
        (10**30, {"$t": "int", "v": hex(10**30)}),
    ],
)
def test_encode_int_boundary(v, expected):
    assert protocol.encode_int(v) == expected
    if isinstance(expected, dict):
        assert int(expected["v"], 16) == v


def test_encode_float():
    assert protocol.encode_float(0.1) == 0.1
    assert protocol.encode_float(float("-inf")) == {"$t": "float", "v": "-inf"}
    assert protocol.encode_float(float("nan")) == {"$t": "float", "v": "nan"}


class Node:  # a "trusted prefix" class: travels by value
    def __init__(self, val, next=None):
        self.val, self.next = val, next


def _tags(x, out: set) -> set:
    if isinstance(x, list):
        for y in x:
            _tags(y, out)
    elif isinstance(x, dict):
        if protocol.TAG in x:
            out.add(x[protocol.TAG])
        for y in x.values():
            _tags(y, out)
    return out


def _wire(x):  # what crosses the pipe: JSON text and back
    return json.loads(json.dumps(x))


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, Node):
        return type(b) is Node and _same(a.val, b.val) and _same(a.next, b.next)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_arguments_trusted_to_program_use_exactly_the_protocol_tags(zygote):
    program_ns = {"Node": Node, "f": len}
    program = zygote._Codec(program_ns, ["Node"])
    target = object()
    program.encode(target)  # the program handed out handle 1 earlier
    session = object()
    trusted = _Codec(session, {"Node": Node})
    shared = Node(1)
    args = [
        None,
        True,
        "s",
        1.5,
        7,
        2**70,
        -(2**60),
        math.inf,
        math.nan,
        (1, (2,)),
        {3},
        frozenset({4}),
        {(1, 2): [3], "k": None},
        b"\x00\xff",
        bytearray(b"ab"),
        1 + 2j,
        range(1, 9, 2),
        [shared, shared],
        Node(2, Node(3)),
    ]
    encoded = _wire(trusted.encode(args))
    assert _tags(encoded, set()) == protocol.TAGS_TO_PROGRAM - {"handle", "global"}
    decoded = program.decode(encoded)
    expected = list(args)
    expected[14] = b"ab"  # a bytearray arrives as bytes
    assert all(_same(e, d) for e, d in zip(expected, decoded)), decoded
    assert decoded[17][0] is decoded[17][1]  # shared structure survives ("ref")
    proxies = [Remote(session, {"name": "f"}, "f"), Remote(session, {"handle": 1}, "object")]
    encoded = _wire(trusted.encode(proxies))
    assert _tags(encoded, set()) == {"global", "handle"}
    assert program.decode(encoded) == [len, target]


def test_results_program_to_trusted_use_exactly_the_protocol_tags(zygote):
    program = zygote._Codec({"Node": Node}, ["Node"])
    shared = Node(1)
    unsendable = object()
    results = [
        None,
        False,
        "s",
        -0.25,
        3,
        2**64,
        math.nan,
        -math.inf,
        (1, [2]),
        {5},
        frozenset({6}),
        {1: "a", (2,): 3.0},
        b"xy",
        3 - 1j,
        range(0, 10, 3),
        [shared, shared],
        Node(2, Node(3)),
        fractions.Fraction(1, 3),
        decimal.Decimal("1.25"),
        unsendable,
    ]
    encoded = _wire(program.encode(results))
    encoded_iter = _wire(program.encode(iter([1, (2,)])))
    seen = _tags(encoded, set()) | _tags(encoded_iter, set())
    assert seen == protocol.TAGS_FROM_PROGRAM
    trusted = _Codec(object(), {"Node": Node})
    decoded = trusted.decode_reply(encoded)
    assert all(_same(e, d) for e, d in zip(results[:-1], decoded[:-1])), decoded
    assert decoded[15][0] is decoded[15][1]
    assert isinstance(decoded[-1], Remote) and repr(decoded[-1]) == "<sandboxed object>"
    assert list(trusted.decode_reply(encoded_iter)) == [1, (2,)]


def test_the_trusted_side_refuses_a_reply_over_the_protocol_limit():
    # A reply frame's body is {"ok": true, "value": "<the string>"}: the string's length plus this.
    overhead = len(json.dumps({"ok": True, "value": ""}))
    at_limit = protocol.MAX_REPLY_BYTES - overhead
    gt = {
        "format": "call",
        "fn_name": "f",
        "inputs": [[at_limit], [at_limit + 1]],
        "outputs": ["x" * at_limit, "x" * (at_limit + 1)],
    }
    program = "def f(n):\n    return 'x' * n\n"
    with Sandbox(SandboxConfig(time_limit_s=20.0, program_time_limit_s=60.0)) as box:
        statuses, detail = run_tests(program, parse_ground_truth(gt), sandbox=box)
    assert statuses == ["pass", "runtime_error"]
    assert f"reply of {protocol.MAX_REPLY_BYTES + 1} bytes exceeds {protocol.MAX_REPLY_BYTES}" in detail
