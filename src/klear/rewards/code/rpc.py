"""The trusted side of the run channel: proxies for what a sandboxed program defines.

klear's design (the paper only says programs run in a sandbox, Sec. 3.2.4). For ``call`` and
``assert`` tests the program runs in the sandbox as a server (:mod:`klear.rewards.sandbox_protocol`
describes the messages and the value encoding); this module is its trusted client. A
:class:`Session` starts the program and learns the names it defines; :class:`Remote` proxies call
into it. Arguments are encoded here, and replies decode only to builtin values, instances of the
trusted prefix's classes and further proxies, so the trusted test code and every comparison run
outside the program, and nothing the program returns runs here.
"""

from __future__ import annotations

import builtins
import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

from klear.rewards.sandbox import RpcChannel, Sandbox
from klear.rewards.sandbox_protocol import OP_CALL, TAG, encode_float, encode_int


class RemoteError(Exception):
    """An exception raised inside the sandboxed program (its type name and message)."""


_BUILTIN_EXC = {
    name: obj
    for name, obj in vars(builtins).items()
    if isinstance(obj, type)
    and issubclass(obj, Exception)
    and obj not in (AssertionError, StopIteration, StopAsyncIteration)
}


class Remote:
    """Proxy for something that lives in the sandboxed program (a function, class or object)."""

    __slots__ = ("_session", "_target", "_name")

    def __init__(self, session: Session, target: dict, name: str):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.call(self._target, None, args, kwargs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        session, target = self._session, self._target
        return _RemoteMethod(session, target, attr)

    def __eq__(self, other: object) -> bool:  # identity only: a program cannot make == lie
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<sandboxed {self._name}>"


class _RemoteMethod:
    """Proxy for a method of something in the sandboxed program (``remote.attr``)."""

    __slots__ = ("_session", "_target", "_attr")

    def __init__(self, session: Session, target: dict, attr: str):
        self._session, self._target, self._attr = session, target, attr

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._session.call(self._target, self._attr, args, kwargs)

    def __repr__(self) -> str:
        return f"<sandboxed method {self._attr}>"


# the containers the wire carries as a list of items (sandbox_protocol's value tags)
_CONTAINERS: dict[str, Callable[[list[Any]], Any]] = {"tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}


class _Codec:
    """Trusted encoder/decoder: only builtin types, instances of the trusted prefix's classes
    and handles ever come out of :meth:`decode`."""

    def __init__(self, session: Session, value_classes: dict[str, type]):
        self.session = session
        self.value_classes = value_classes

    def encode(self, x: Any, memo: dict | None = None, depth: int = 0) -> Any:
        memo = {} if memo is None else memo
        if depth > 5000:
            raise ValueError("argument nested too deeply")
        t = type(x)
        enc = lambda y: self.encode(y, memo, depth + 1)  # noqa: E731
        if x is None or t in (bool, str):
            return x
        if t is int:
            return encode_int(x)
        if t is float:
            return encode_float(x)
        if t is list:
            return [enc(y) for y in x]
        if t is tuple:
            return {TAG: "tuple", "v": [enc(y) for y in x]}
        if t in (set, frozenset):
            return {TAG: "set" if t is set else "frozenset", "v": [enc(y) for y in x]}
        if t is dict:
            return {TAG: "dict", "v": [[enc(k), enc(v)] for k, v in x.items()]}
        if t in (bytes, bytearray):
            return {TAG: "bytes", "v": bytes(x).hex()}
        if t is complex:
            return {TAG: "complex", "v": [x.real, x.imag]}
        if t is range:
            return {TAG: "range", "v": [x.start, x.stop, x.step]}
        if isinstance(x, Remote) and object.__getattribute__(x, "_session") is self.session:
            target = object.__getattribute__(x, "_target")
            if "handle" in target:
                return {TAG: "handle", "id": target["handle"]}
            return {TAG: "global", "name": target["name"]}
        if t.__name__ in self.value_classes and self.value_classes[t.__name__] is t:
            if id(x) in memo:
                return {TAG: "ref", "id": memo[id(x)]}
            memo[id(x)] = len(memo) + 1
            return {TAG: "obj", "cls": t.__name__, "id": memo[id(x)], "v": {k: enc(v) for k, v in vars(x).items()}}
        raise TypeError(f"cannot pass a {t.__name__} to the sandboxed program")

    #: Most values (containers and items) one reply may decode to, and the longest range.
    MAX_ITEMS = 2_000_000
    MAX_RANGE = 1_000_000

    def decode_reply(self, x: Any) -> Any:
        """Decode one reply from the program within :attr:`MAX_ITEMS` (raises ``ValueError`` past it,
        and for ranges longer than :attr:`MAX_RANGE` or sets/dicts built from hash-colliding keys,
        so a 40-byte reply cannot make this trusted process do unbounded work)."""
        self._budget = self.MAX_ITEMS
        try:
            return self.decode(x)
        except RecursionError:
            raise ValueError("value nested too deeply") from None

    @staticmethod
    def _no_collisions(items: list) -> None:
        if len(items) > 512:
            counts = collections.Counter(hash(k) for k in items)
            if counts.most_common(1)[0][1] > 64:
                raise ValueError("set/dict keys with colliding hashes")

    def decode(self, x: Any, memo: dict | None = None) -> Any:
        memo = {} if memo is None else memo
        self._budget = getattr(self, "_budget", self.MAX_ITEMS) - 1
        if self._budget < 0:
            raise ValueError("reply too large")
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.decode(y, memo) for y in x]
        if type(x) is not dict:
            raise ValueError("malformed value")
        t, v = x.get(TAG), x.get("v")
        dec = lambda y: self.decode(y, memo)  # noqa: E731
        if t == "int" and isinstance(v, str):
            return int(v, 16)
        if t == "float" and v in ("nan", "inf", "-inf"):
            return float(v)
        if t in ("tuple", "set", "frozenset", "iter") and type(v) is list:
            items = [dec(y) for y in v]
            if t in ("set", "frozenset"):
                self._no_collisions(items)
            return _CONTAINERS[t](items)
        if t == "dict" and type(v) is list:
            pairs = []
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise ValueError("malformed dict")
                pairs.append((dec(pair[0]), dec(pair[1])))
            self._no_collisions([k for k, _ in pairs])
            return dict(pairs)
        if t == "bytes" and isinstance(v, str):
            return bytes.fromhex(v)
        if t == "complex" and type(v) is list and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if t == "range" and type(v) is list and len(v) == 3 and all(type(i) is int for i in v):
            r = range(*v)
            if len(r) > self.MAX_RANGE:
                raise ValueError(f"range of {len(r)} items")
            return r
        if t in ("fractions", "decimal") and isinstance(v, str):
            import decimal
            import fractions

            return fractions.Fraction(v) if t == "fractions" else decimal.Decimal(v)
        if t == "ref" and x.get("id") in memo:
            return memo[x["id"]]
        if t == "handle" and type(x.get("id")) is int:
            return Remote(self.session, {"handle": x["id"]}, str(x.get("cls", "object"))[:100])
        if t == "obj" and type(v) is dict and x.get("cls") in self.value_classes:
            cls = self.value_classes[x["cls"]]
            obj: Any = object.__new__(cls)
            memo[x.get("id")] = obj
            for k, w in v.items():
                if not isinstance(k, str):
                    raise ValueError("malformed object")
                object.__setattr__(obj, k, dec(w))
            return obj
        raise ValueError(f"malformed value (tag {t!r})")


class Session:
    """One running copy of the program in rpc mode, seen from the trusted side.

    Args:
        sandbox: runs the program (:meth:`~klear.rewards.sandbox.Sandbox.start_rpc`).
        workdir, program, prefix, setup: the run's directory and files in it (prefix and setup
            may be None).
        value_classes: the trusted prefix's classes (name -> class), passed by value.
        deadline: ``time.monotonic()`` time by which the program must have loaded.

    Raises:
        RemoteError: the program failed to load (compile error, exception, ``exit()``).
        TimeoutError, EOFError, ValueError: it did not answer in time, died, or sent a
            malformed message.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        workdir: Path,
        program: Path,
        prefix: Path | None,
        setup: Path | None,
        value_classes: dict[str, type],
        deadline: float,
    ):
        self.chan: RpcChannel = sandbox.start_rpc(workdir, program, prefix, setup)
        self.chan.deadline = deadline
        self.codec = _Codec(self, value_classes)
        self.alive = True
        try:
            msg = self.chan.recv()
        except BaseException:
            self.close()
            raise
        if not msg.get("ok"):
            self.close()
            raise RemoteError(str(msg.get("error", "load error"))[:500])
        names = msg.get("names")
        names = names if isinstance(names, dict) else {}
        #: The names the program (with prefix and setup) defines: ``"class"``, ``"function"`` or ``"value"``.
        self.names = {k: v for k, v in names.items() if isinstance(k, str) and k.isidentifier()}
        setup = msg.get("setup_names")
        #: The names the ground truth's setup code created or rebound.
        self.setup_names = {k for k in setup if isinstance(k, str)} if isinstance(setup, list) else set()

    def call(self, target: dict, attr: str | None, args: tuple, kwargs: dict) -> Any:
        """Call ``target`` (``{"name": ...}`` or ``{"handle": ...}``), or its method *attr*, in the
        program; returns the decoded result.

        Raises:
            An exception of the builtin type the program raised (``ValueError``, ``KeyError``...;
            :class:`RemoteError` for its own types, ``AssertionError`` and ``StopIteration``);
            ``TimeoutError`` / ``EOFError``: no reply by the deadline, or the program died (the
            session is closed); ``ValueError``: a malformed or oversized reply; ``TypeError``: an
            argument that cannot be sent.
        """
        if not self.alive:
            raise RemoteError("the program is no longer running")
        req = {
            "op": OP_CALL,
            "target": target,
            "attr": attr,
            "args": self.codec.encode(list(args)),
            "kwargs": self.codec.encode(dict(kwargs)),
        }
        try:
            self.chan.send(req)
            reply = self.chan.recv()
        except BaseException:
            self.close()
            raise
        if reply.get("ok") is True:
            return self.codec.decode_reply(reply.get("value"))
        err = str(reply.get("error", "error"))[:2000]
        name = err.split(":", 1)[0]
        exc = _BUILTIN_EXC.get(name)
        raise (exc(err) if exc is not None else RemoteError(err))

    def proxy(self, name: str) -> Remote:
        """A proxy for the program's top-level *name*."""
        return Remote(self, {"name": name}, name)

    def close(self) -> None:
        """Kill the program (idempotent)."""
        if self.alive:
            self.alive = False
            self.chan.close()
