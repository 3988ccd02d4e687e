"""The sandbox wire protocol: what the trusted side and the sandbox zygote say to each other.

klear's own design (the paper only says code runs "in a sandbox", Sec. 3.2.4). This module is the
one description of the protocol, and the one place its constants and framing are written. Both
sides use it: :mod:`klear.rewards.sandbox` and :mod:`klear.rewards.code.rpc` import it;
``_sandbox_zygote.py``, which runs as a script with ``python -I`` outside the klear package,
loads this file by path. It therefore imports only the standard library.

**Control channel** (parent :class:`~klear.rewards.sandbox.Sandbox` <-> zygote). One
``AF_UNIX``/``SOCK_SEQPACKET`` socket pair; the zygote is started as
``python -I -B _sandbox_zygote.py FD ROOT MODE SCRATCH_BYTES CGROUP_FDS`` with ``FD`` its end.
Each packet is one UTF-8 JSON object of at most :data:`CONTROL_PACKET_BYTES`; file descriptors
travel with a packet as ``SCM_RIGHTS`` (at most :data:`CONTROL_MAX_FDS`). Requests carry an
``id`` (a string), echoed in the reply so replies can be matched while ``exit`` packets arrive
in between.

============================  ===================================================================
``hello`` (zygote, once)      ``{"op", "pid", "root", "net_isolated", "notes": [str]}``: ready;
                              how the zygote is isolated (a note containing ``NOT`` is a
                              weakness the parent logs)
``spawn`` -> ``spawned``      ``{"op", "id", "mode": "stdio"|"rpc", "workdir", "program",
                              "prefix", "setup", "uid", "gid", "limits", "env",
                              "recursion_limit", "allowed_packages"}`` with the child's
                              descriptors (stdio: stdin, stdout, stderr; rpc: the same, then the
                              run channel's request and reply pipes) -> ``{"op", "id", "pid"}``.
                              Paths are file locations (the zygote reads the sources), never
                              test data.
``reap`` -> ``reaped``        ``{"op", "id", "uid"}``: kill every process of ``uid`` (root; else
                              a no-op) -> ``{"op", "id"}``
``kill`` (no reply)           ``{"op", "pid"}``: SIGKILL a run's process group (the pid may live
                              in a pid namespace only the zygote sees); its ``exit`` follows
``exit`` (zygote, unasked)    ``{"op", "pid", "status"}``: a run ended (raw wait status), sent
                              after whatever it left behind was killed
============================  ===================================================================

The parent stops the zygote by closing its end (the zygote also dies with its parent).

**Run channel** (trusted side <-> one program started in ``rpc`` mode). Two pipes, the child's
descriptors :data:`REQUEST_FD` (requests in) and :data:`REPLY_FD` (replies out); its stdio is
``/dev/null``. A frame is a 4-byte big-endian unsigned length (:data:`FRAME_HEADER`) followed
by that many bytes of one UTF-8 JSON object. The program refuses requests longer than
:data:`MAX_REQUEST_BYTES`, the trusted side replies longer than :data:`MAX_REPLY_BYTES` and
waits for every reply only until its deadline. Messages, in order:

1. program -> trusted, once: ``{"op": "loaded", "ok": true, "names": {name: "class" |
   "function" | "value"}, "setup_names": [name]}`` (what the trusted prefix, the program and
   the ground truth's setup code defined; ``setup_names``: what the setup created), or
   ``{"op": "loaded", "ok": false, "error": "Type: message"}`` when loading failed.
2. trusted -> program, repeated: ``{"op": "call", "target": {"name": name} | {"handle": id},
   "attr": name | null, "args": <value: a list>, "kwargs": <value: a dict>}`` ->
   ``{"ok": true, "value": <value>}`` or ``{"ok": false, "error": "Type: message"}``.

The trusted side ends a run by killing the program, never by asking it.

**Values.** JSON ``null``, booleans, strings, finite floats and ints with ``|v| <`` 2**53
(:data:`JSON_INT_LIMIT`) stand for themselves and JSON arrays are lists; every other value is
an object whose :data:`TAG` key names its type:

=========================  ======================================================================
``int``                    ``{"v": hex}``: an int beyond JSON's exact range (any size)
``float``                  ``{"v": "nan" | "inf" | "-inf"}``
``tuple``, ``set``,        ``{"v": [value]}``
``frozenset``
``dict``                   ``{"v": [[key, value]]}`` (any key type, order kept)
``bytes``                  ``{"v": hex}``
``complex``                ``{"v": [real, imag]}``
``range``                  ``{"v": [start, stop, step]}``
``obj``                    ``{"cls", "id", "v": {attribute: value}}``: an instance of a class the
                           trusted prefix defines (``ListNode``, ``TreeNode``), by value
``ref``                    ``{"id"}``: the ``obj`` with that ``id`` earlier in the same message
                           (shared and cyclic structures survive)
``handle``                 ``{"id"}``: an object that stays in the program, named by the id the
                           program gave it; from the program also ``"cls"`` and ``"callable"``
``global`` (to program)    ``{"name"}``: a name the program defines
``iter`` (from program)    ``{"v": [value]}``: an iterator or generator, drained
``fractions``, ``decimal``  ``{"v": str}``: a ``Fraction`` / ``Decimal``
(from program)
=========================  ======================================================================

numpy values travel as their ``tolist()``. The trusted decoder turns a reply into builtin
values, instances of the prefix's classes and proxies for handles, and nothing else: a program
cannot make the trusted side run its code.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Sequence

# ------------------------------------------------------------------------- control channel

#: Largest control packet either side reads (bytes).
CONTROL_PACKET_BYTES = 1 << 20
#: Most file descriptors one control packet carries.
CONTROL_MAX_FDS = 8

OP_HELLO = "hello"
OP_SPAWN = "spawn"
OP_SPAWNED = "spawned"
OP_REAP = "reap"
OP_REAPED = "reaped"
OP_KILL = "kill"
OP_EXIT = "exit"

#: ``spawn`` modes: a stdin/stdout run, or a program serving the run channel.
MODE_STDIO = "stdio"
MODE_RPC = "rpc"


def send_packet(sock: socket.socket, obj: dict, fds: Sequence[int] = ()) -> None:
    """Send *obj* as one control packet, with *fds* attached (``SCM_RIGHTS``) when there are any.

    Raises:
        OSError: the socket is closed or the packet is larger than the socket allows.
    """
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


# ----------------------------------------------------------------------------- run channel

#: The program's descriptors for the run channel (after stdin, stdout, stderr).
REQUEST_FD = 3
REPLY_FD = 4
#: A frame's length prefix: 4-byte big-endian unsigned.
FRAME_HEADER = struct.Struct(">I")
#: Longest request the program accepts (bytes).
MAX_REQUEST_BYTES = 64 << 20
#: Longest reply the trusted side accepts (bytes).
MAX_REPLY_BYTES = 16 << 20

OP_LOADED = "loaded"
OP_CALL = "call"


def frame(obj: dict, *, allow_nan: bool = True) -> bytes:
    """*obj* as one run-channel frame (length prefix + UTF-8 JSON).

    ``allow_nan=False`` (the program's replies) raises ``ValueError`` for a non-finite float that
    was not tagged; ``TypeError`` for anything JSON cannot hold.
    """
    data = json.dumps(obj, allow_nan=allow_nan).encode()
    return FRAME_HEADER.pack(len(data)) + data


def frame_length(header: bytes, limit: int, what: str) -> int:
    """The body length a frame header announces.

    Args:
        header: the frame's first :data:`FRAME_HEADER` ``.size`` (4) bytes.
        limit: the largest body this side accepts, in bytes.
        what: the message kind, for the error (``"request"``, ``"reply"``).

    Raises:
        ValueError: the length exceeds *limit*.
    """
    (n,) = FRAME_HEADER.unpack(header)
    if n > limit:
        raise ValueError(f"{what} of {n} bytes exceeds {limit}")
    return n


# ---------------------------------------------------------------------------------- values

#: The key naming a tagged value's type.
TAG = "$t"
#: Ints with ``abs(v) < JSON_INT_LIMIT`` are JSON numbers; larger ones are tagged ``int``.
JSON_INT_LIMIT = 1 << 53

_TAGS_BOTH = frozenset(
    {"int", "float", "tuple", "set", "frozenset", "dict", "bytes", "complex", "range", "obj", "ref", "handle"}
)
#: Tags the trusted side sends (call arguments).
TAGS_TO_PROGRAM = _TAGS_BOTH | {"global"}
#: Tags the program sends (results).
TAGS_FROM_PROGRAM = _TAGS_BOTH | {"iter", "fractions", "decimal"}


def encode_int(v: int) -> int | dict:
    """An exact int as a JSON number, or tagged ``int`` (hex text) beyond :data:`JSON_INT_LIMIT`."""
    return v if -JSON_INT_LIMIT < v < JSON_INT_LIMIT else {TAG: "int", "v": hex(v)}


def encode_float(v: float) -> float | dict:
    """A finite float as a JSON number; ``nan`` / ``inf`` / ``-inf`` tagged ``float``."""
    return v if math.isfinite(v) else {TAG: "float", "v": repr(v)}
