"""A fault-injecting HTTP/1.1 proxy for the object-storage tests (tests/python/test_flaky_s3.py).

It sits between ckptstore's S3 client and the S3 server (s3s-fs) on loopback: the client's
``AWS_ENDPOINT_URL`` points at the proxy, which forwards each request to the server and can
instead, or on the way, inject one fault per request:

========================  ==================================================================
action                    what the client sees
========================  ==================================================================
``PASS``                  the server's response, unchanged (bodies re-framed with a
                          Content-Length: a chunked response is sent de-chunked)
``status(503)``           ``503 Slow Down`` with S3's ``<Code>SlowDown</Code>`` XML; the
                          request is not forwarded (nothing happens on the server)
``status(500)``           ``500`` with ``<Code>InternalError</Code>``, not forwarded
``reset(n)``              the request is forwarded, the response head and the first ``n``
                          body bytes sent, then the connection is reset (TCP RST)
``lose_response()``       the request is forwarded (the server acts on it), then RST
                          before any byte of the response: the client cannot know
``reset_request(n)``      ``n`` bytes of the request body are read, then RST; nothing is
                          forwarded (a PUT cut mid-upload)
``truncate(n)``           the response head with its true Content-Length, then only the
                          first ``n`` body bytes, then a clean close (FIN)
``short(n)``              the first ``n`` body bytes with Content-Length (and the
                          Content-Range end) rewritten to match: a well-framed short body
``corrupt(i)``            the whole response with body byte ``i`` flipped (same length)
``delay(s)``              a latency spike: ``s`` seconds, then forwarded unchanged
``stall(s)``              the request is read, then nothing is sent for ``s`` seconds
                          (the connection stays open, silent), then RST. The hold is
                          finite so that a client without its own bound finishes anyway
========================  ==================================================================

**Determinism.** No fault depends on wall-clock races. Each request is matched against a
list of :class:`Rule` objects in order; the first rule that matches decides the action
from the number of requests *it* has matched so far (1-based: "the 2nd GET of a shard
object gets a 503"), or, for :class:`SeededMix`, from a hash of (seed, method, key with
checkpoint ids masked, part number, per-key attempt number), so that a seed decides every
fault whatever order concurrent requests arrive in. Counters are kept under a lock.
:attr:`FlakyProxy.log` records every request with the action taken, for assertions that
retries happened (``proxy.count("GET", "shard-*")``).

**Why not a maintained package.** Toxiproxy (and its Python client, toxiproxy-python) needs
its Go server binary, which no registry reachable here ships (not on PyPI, not a Debian
package), and its toxics act on TCP streams, not on HTTP requests: they cannot answer one
request of a keep-alive connection with a 503, keep a true Content-Length over a truncated
body, or count attempts per object key. mitmproxy could, but it is a large dependency
(its own TLS stack, dozens of packages) for ~300 lines of standard library, and buffers
bodies, which makes "reset after n body bytes" awkward. toxic-proxy (PyPI) is another TCP-
level proxy, unmaintained. So this is a small threaded proxy on the standard library.

It parses what it needs: the request line, headers, the body (Content-Length or chunked),
and the response's status line, headers and body (Content-Length, chunked, or none for
HEAD / 204 / 304). Header bytes are forwarded verbatim (SigV4 signs the Host header, so it
is not rewritten); each client request is forwarded on a fresh connection to the server.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union
from urllib.parse import parse_qs, unquote, urlsplit

_ID = re.compile(r"[0-9a-f]{32}")


# ---- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    kind: str  # pass | status | reset | reset_request | truncate | short | corrupt | delay | stall
    arg: float = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "pass" else f"{self.kind}({self.arg:g})"


PASS = Action("pass")


def status(code: int) -> Action:
    return Action("status", code)


def reset(after_body_bytes: int = 0) -> Action:
    return Action("reset", after_body_bytes)


def lose_response() -> Action:
    return Action("reset", -1)


def reset_request(after_body_bytes: int = 0) -> Action:
    return Action("reset_request", after_body_bytes)


def truncate(keep: int) -> Action:
    return Action("truncate", keep)


def short(keep: int) -> Action:
    return Action("short", keep)


def corrupt(at: int) -> Action:
    return Action("corrupt", at)


def delay(seconds: float) -> Action:
    return Action("delay", seconds)


def stall(seconds: float) -> Action:
    return Action("stall", seconds)


_REASONS = {500: "Internal Server Error", 503: "Slow Down", 429: "Too Many Requests"}
_CODES = {500: "InternalError", 503: "SlowDown", 429: "SlowDown"}


# ---- requests and rules ---------------------------------------------------------------------


@dataclass
class Request:
    """What the proxy knows of one client request."""

    method: str
    target: str  # the request target, as sent
    bucket: str
    key: str  # the object key (path-style URL: /bucket/key), "" for bucket requests
    query: Dict[str, List[str]]
    headers: Dict[str, str]  # lower-case names
    body_len: int = 0
    action: Action = PASS
    upstream_status: Optional[int] = None
    attempt: int = 0  # 1-based count of requests with the same identity

    @property
    def name(self) -> str:
        """The last segment of the key (``shard-<id>-0.safetensors``)."""
        return self.key.rsplit("/", 1)[-1]

    @property
    def masked_key(self) -> str:
        """The key with every 32-hex checkpoint / upload id replaced by ``<id>``."""
        return _ID.sub("<id>", self.key)

    @property
    def identity(self) -> tuple:
        """What a retry of this request shares with it: method, masked key (or, for a
        listing, the masked prefix listed), part number."""
        where = self.masked_key or "?prefix=" + _ID.sub("<id>", (self.query.get("prefix") or [""])[0])
        return (self.method, where, self.part)

    @property
    def part(self) -> Optional[str]:
        return (self.query.get("partNumber") or [None])[0]

    @property
    def range(self) -> Optional[Tuple[int, int]]:
        """``(first, last)`` byte of a ``Range: bytes=a-b`` header, else None."""
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("range", "").strip())
        if not m:
            return None
        return int(m.group(1)), int(m.group(2)) if m.group(2) else -1

    def kind(self) -> str:
        """A coarse name of the S3 call: list, get, head, put, put-part, create-upload,
        complete-upload, abort-upload, delete, delete-many, other."""
        q, m = self.query, self.method
        if m == "GET" and not self.key:
            return "list"
        if m == "GET":
            return "get"
        if m == "HEAD":
            return "head"
        if m == "PUT":
            return "put-part" if "partNumber" in q else "put"
        if m == "POST" and "uploads" in q:
            return "create-upload"
        if m == "POST" and "uploadId" in q:
            return "complete-upload"
        if m == "POST" and "delete" in q:
            return "delete-many"
        if m == "DELETE":
            return "abort-upload" if "uploadId" in q else "delete"
        return "other"


Matcher = Union[Callable[[Request], bool], Dict[str, object]]


def match(method: Optional[str] = None, name: Optional[str] = None, kind: Optional[str] = None,
          ranged: Optional[bool] = None, from_byte: Optional[int] = None) -> Callable[[Request], bool]:
    """A matcher: ``method`` exact, ``name`` an fnmatch glob of the key's last segment,
    ``kind`` one of :meth:`Request.kind`, ``ranged`` whether a Range header is present,
    ``from_byte``: the Range starts at or after this byte."""

    def f(r: Request) -> bool:
        if method is not None and r.method != method:
            return False
        if name is not None and not fnmatch.fnmatchcase(r.name, name):
            return False
        if kind is not None and r.kind() != kind:
            return False
        if ranged is not None and (r.range is not None) != ranged:
            return False
        if from_byte is not None and (r.range is None or r.range[0] < from_byte):
            return False
        return True

    return f


class Rule:
    """Requests that ``when`` matches get ``actions``: a list (the n-th matching request gets
    item n-1, later ones ``then``), a dict ``{n: action}`` (1-based, others ``then``), or a
    callable ``(n, request) -> action``."""

    def __init__(self, when: Callable[[Request], bool],
                 actions: Union[Sequence[Action], Dict[int, Action], Callable[[int, Request], Action]],
                 then: Action = PASS) -> None:
        self.when = when
        self.actions = actions
        self.then = then
        self.matched = 0

    def decide(self, r: Request) -> Action:
        self.matched += 1
        n = self.matched
        a = self.actions
        if callable(a):
            return a(n, r)
        if isinstance(a, dict):
            return a.get(n, self.then)
        return a[n - 1] if n <= len(a) else self.then


class SeededMix:
    """A random mix of faults decided by a seed: each request draws a fault with probability
    ``p`` from ``faults`` (with weights), by a hash of (seed, method, masked key, part
    number, attempt number of that identity): the same seed gives the same faults whatever
    order concurrent requests on different keys arrive in. ``limit``: after this many
    faulty attempts in a row for one identity the next one passes (keeps a mix within a
    retry budget; ``None``: no limit). ``adjust(request, action) -> action`` may replace a
    drawn fault (to keep one out of some kinds of request)."""

    def __init__(self, seed: int, p: float, faults: Sequence[Tuple[Action, float]],
                 limit: Optional[int] = None,
                 adjust: Optional[Callable[[Request, Action], Action]] = None) -> None:
        self.seed, self.p, self.faults, self.limit = seed, p, list(faults), limit
        self.adjust = adjust
        self._run: Dict[tuple, int] = {}

    def _u(self, *parts: object) -> float:
        h = hashlib.sha256(repr((self.seed,) + parts).encode()).digest()
        return int.from_bytes(h[:8], "little") / 2.0**64

    def _draw(self, r: Request) -> Action:
        ident = r.identity + (r.attempt,)
        if self._u("p", *ident) >= self.p:
            return PASS
        total = sum(w for _, w in self.faults)
        x = self._u("which", *ident) * total
        for a, w in self.faults:
            x -= w
            if x < 0:
                return a
        return self.faults[-1][0]

    def decide(self, r: Request) -> Action:
        """Called under the proxy's lock."""
        run = self._run.get(r.identity, 0)
        a = PASS if self.limit is not None and run >= self.limit else self._draw(r)
        if a != PASS and self.adjust is not None:
            a = self.adjust(r, a)
        self._run[r.identity] = run + 1 if a != PASS else 0
        return a


# ---- HTTP plumbing --------------------------------------------------------------------------


class _Closed(Exception):
    pass


def _read_head(f) -> Optional[Tuple[bytes, List[Tuple[bytes, bytes]], bytes]]:
    """(start line, [(name, value)], raw head bytes) or None at a clean EOF."""
    line = f.readline(65537)
    if not line:
        return None
    raw = [line]
    headers = []
    while True:
        h = f.readline(65537)
        if not h:
            raise _Closed("EOF in headers")
        raw.append(h)
        if h in (b"\r\n", b"\n"):
            break
        name, _, value = h.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    return line.rstrip(b"\r\n"), headers, b"".join(raw)


def _hget(headers: List[Tuple[bytes, bytes]], name: bytes) -> Optional[bytes]:
    for n, v in headers:
        if n == name:
            return v
    return None


def _read_body(f, headers: List[Tuple[bytes, bytes]], limit: Optional[int] = None) -> bytes:
    """The body framed by Content-Length or chunked encoding (de-chunked). ``limit``: stop
    after that many bytes (for a reset mid-upload)."""
    te = (_hget(headers, b"transfer-encoding") or b"").lower()
    if b"chunked" in te:
        out = bytearray()
        while True:
            size_line = f.readline(65537)
            if not size_line:
                raise _Closed("EOF in chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while f.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            out += _read_exact(f, size)
            f.readline(65537)
            if limit is not None and len(out) >= limit:
                return bytes(out[:limit])
    n = int(_hget(headers, b"content-length") or b"0")
    if limit is not None:
        n = min(n, limit)
    return _read_exact(f, n)


def _read_exact(f, n: int) -> bytes:
    b = f.read(n) if n else b""
    if len(b) != n:
        raise _Closed("EOF in body")
    return b


def _rst(sock: socket.socket) -> None:
    """Close with a TCP reset."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _head_bytes(status_line: bytes, headers: List[Tuple[bytes, bytes]]) -> bytes:
    lines = [status_line] + [n + b": " + v for n, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _s3_error(code: int, r: Request) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{_CODES.get(code, 'InternalError')}</Code>"
        f"<Message>injected by flaky_proxy</Message><Resource>/{r.bucket}/{r.key}</Resource>"
        "<RequestId>flaky</RequestId></Error>"
    ).encode()
    head = [
        (b"content-type", b"application/xml"),
        (b"content-length", str(len(body)).encode()),
    ]
    if code in (503, 429):
        head.append((b"retry-after", b"0"))
    line = f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}".encode()
    return _head_bytes(line, head) + (b"" if r.method == "HEAD" else body)


# ---- the proxy ------------------------------------------------------------------------------


@dataclass
class FlakyProxy:
    """A fault-injecting proxy to ``upstream`` (host, port), listening on 127.0.0.1:0.

    ``rules``: a list of :class:`Rule` (first match decides); ``mix``: a
    :class:`SeededMix` for requests no rule matches. Use as a context manager, or
    :meth:`start` / :meth:`stop`. :attr:`url` is the endpoint to give the client."""

    upstream: Tuple[str, int]
    rules: List[Rule] = field(default_factory=list)
    mix: Optional[SeededMix] = None
    log: List[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._attempts: Dict[tuple, int] = {}
        self._stop = threading.Event()
        self._socks: set = set()
        self._threads: List[threading.Thread] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    # -- control

    def start(self) -> "FlakyProxy":
        t = threading.Thread(target=self._accept, name="flaky-proxy", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        try:  # wakes the accept() of the accepting thread (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            except OSError:
                pass
            _rst(s)
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> "FlakyProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set(self, *rules: Rule, mix: Optional[SeededMix] = None) -> None:
        """Replace the fault plan and forget the counts and the log."""
        with self._lock:
            self.rules = list(rules)
            self.mix = mix
            self.log = []
            self._attempts = {}

    def requests(self, method: Optional[str] = None, name: Optional[str] = None,
                 kind: Optional[str] = None) -> List[Request]:
        """The logged requests that match (as :func:`match`)."""
        m = match(method=method, name=name, kind=kind)
        with self._lock:
            return [r for r in self.log if m(r)]

    def count(self, method: Optional[str] = None, name: Optional[str] = None,
              kind: Optional[str] = None) -> int:
        return len(self.requests(method, name, kind))

    def faults(self) -> List[Request]:
        """The logged requests that got a fault (anything but PASS)."""
        with self._lock:
            return [r for r in self.log if r.action != PASS]

    def summary(self) -> str:
        with self._lock:
            return "\n".join(
                f"{r.method} {r.key or '/' + r.bucket} {r.headers.get('range', '')} "
                f"part={r.part} #{r.attempt}: {r.action} -> {r.upstream_status}"
                for r in self.log
            )

    # -- serving

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(c)
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _decide(self, r: Request) -> Action:
        with self._lock:
            ident = r.identity
            self._attempts[ident] = r.attempt = self._attempts.get(ident, 0) + 1
            a = PASS
            for rule in self.rules:
                if rule.when(r):
                    a = rule.decide(r)
                    break
            else:
                if self.mix is not None:
                    a = self.mix.decide(r)
            r.action = a
            self.log.append(r)
            return a

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while not self._stop.is_set():
                if not self._one(c, f):
                    break
        except (_Closed, OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._socks.discard(c)
            try:
                f.close()
            except OSError:
                pass
            try:
                c.close()
            except OSError:
                pass

    def _one(self, c: socket.socket, f) -> bool:
        """Serve one request; False to close the connection."""
        got = _read_head(f)
        if got is None:
            return False
        line, headers, raw_head = got
        method, target, _ = line.decode("latin-1").split(" ", 2)
        u = urlsplit(target)
        path = unquote(u.path).lstrip("/")
        bucket, _, key = path.partition("/")
        r = Request(
            method=method, target=target, bucket=bucket, key=key,
            query=parse_qs(u.query, keep_blank_values=True),
            headers={n.decode("latin-1"): v.decode("latin-1") for n, v in headers},
        )
        a = self._decide(r)
        if a.kind == "reset_request":
            _read_body(f, headers, limit=int(a.arg))
            _rst(c)
            return False
        body = _read_body(f, headers)
        r.body_len = len(body)
        if a.kind == "status":
            c.sendall(_s3_error(int(a.arg), r))
            return True
        if a.kind == "stall":
            self._stop.wait(a.arg)
            _rst(c)
            return False
        if a.kind == "delay":
            self._stop.wait(a.arg)
        # Forward on a fresh connection: head verbatim (minus hop-by-hop framing), body
        # re-framed with a Content-Length.
        fwd = [(n, v) for n, v in headers if n not in (b"transfer-encoding", b"content-length", b"connection")]
        if body or method in ("PUT", "POST"):
            fwd.append((b"content-length", str(len(body)).encode()))
        fwd.append((b"connection", b"close"))
        up = socket.create_connection(self.upstream, timeout=60)
        try:
            up.sendall(_head_bytes(line, fwd) + body)
            uf = up.makefile("rb")
            resp = _read_head(uf)
            if resp is None:
                raise _Closed("upstream closed")
            sline, sheaders, _ = resp
            code = int(sline.split()[1])
            r.upstream_status = code
            if method == "HEAD" or code in (204, 304) or 100 <= code < 200:
                sbody = b""
            elif _hget(sheaders, b"content-length") is None and b"chunked" not in (
                _hget(sheaders, b"transfer-encoding") or b"").lower():
                sbody = uf.read()  # close-delimited
            else:
                sbody = _read_body(uf, sheaders)
            uf.close()
        finally:
            up.close()
        out = [(n, v) for n, v in sheaders if n not in (b"transfer-encoding", b"connection", b"content-length")]
        true_len = len(sbody) if method != "HEAD" else int(_hget(sheaders, b"content-length") or b"0")
        keep_alive = (_hget(headers, b"connection") or b"").lower() != b"close"
        if a.kind == "short" and method != "HEAD":
            keep = max(0, min(int(a.arg), len(sbody)))
            sbody = sbody[:keep]
            out = [(n, v) for n, v in out if n != b"content-range"]
            cr = _hget(sheaders, b"content-range")
            m = re.fullmatch(rb"bytes (\d+)-(\d+)/(\d+|\*)", (cr or b"").strip())
            if m and keep > 0:
                first = int(m.group(1))
                out.append((b"content-range", b"bytes %d-%d/%s" % (first, first + keep - 1, m.group(3))))
            out.append((b"content-length", str(keep).encode()))
        else:
            out.append((b"content-length", str(true_len).encode()))
        if a.kind == "corrupt" and sbody:
            i = int(a.arg) % len(sbody)
            sbody = sbody[:i] + bytes([sbody[i] ^ 0x01]) + sbody[i + 1:]
        head = _head_bytes(sline, out)
        if a.kind == "reset":
            if a.arg >= 0:
                c.sendall(head + sbody[: int(a.arg)])
            _rst(c)
            return False
        if a.kind == "truncate":
            c.sendall(head + sbody[: int(a.arg)])
            c.shutdown(socket.SHUT_RDWR)
            return False
        c.sendall(head + sbody)
        return keep_alive
