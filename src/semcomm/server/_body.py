"""Request bodies checked before any work: their size, their encoding and their shape.

Three limits apply to every JSON body, each answered with a 4xx that names the problem, never
a 5xx or a traceback:

- **size** (``server.max_body_bytes``): :class:`BodyLimit` answers a body whose
  ``Content-Length`` exceeds it with 413 before the app sees it (the bytes are read and
  dropped, up to :data:`DRAIN_FACTOR` times the limit, so the client reads the answer and the
  connection stays usable), and one without a length once its bytes pass the limit; nothing
  is parsed or kept. The default is sized from the largest context the configured models
  accept (:func:`default_body_limit`). (Starlette's own ``RequestBodyLimitMiddleware`` answers
  in plain text, not in OpenAI's error shape, and closes the connection.)
- **encoding**: the bytes must be UTF-8 and every string in the JSON valid Unicode (no lone
  surrogates such as ``"\\ud800"``, which JSON allows and UTF-8 cannot encode): 400 naming
  the byte offset or the field;
- **depth**: at most :data:`MAX_DEPTH` nested arrays and objects (Python's parser gives up
  with a RecursionError on ~100k; nothing semcomm accepts nests deeper than a few levels).

:class:`StrictJSONRoute` puts the last two in front of FastAPI's own body parsing, so a
refused body never reaches validation, admission or the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._backends import ModelBackend

__all__ = [
    "DRAIN_FACTOR",
    "MAX_DEPTH",
    "BadBody",
    "BodyLimit",
    "BodyTooLarge",
    "StrictJSONRoute",
    "default_body_limit",
    "parse_json_body",
]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have."""

DRAIN_FACTOR = 32
"""A refused body is read and dropped up to this many times the limit (then the connection
is closed): the client gets its 413 instead of a reset while it is still sending."""

# the default body limit: bytes per token of the largest context (a token is at most a few
# characters of text, and JSON escapes a character in at most 12 bytes: a surrogate pair as
# two \\uXXXX), plus room for the rest of the request; never under 1 MiB
_BYTES_PER_TOKEN = 64
_MIN_BODY = 1 << 20
_SLACK = 64 << 10
# a configured upstream's context is not known here: leave room for a long one
_UPSTREAM_BODY = 8 << 20


class BadBody(HTTPException):
    """A body refused before validation (400), with the field it concerns when there is one."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(status_code=400, detail=message)
        self.param = param


class BodyTooLarge(HTTPException):
    """The body passed ``server.max_body_bytes`` (413). An HTTPException, so that FastAPI's
    body parsing lets it through to the app's handler, which answers in OpenAI's shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"the request body is larger than this server "
                         f"accepts ({limit:,} bytes: server.max_body_bytes)")
        self.limit = limit


class BodyLimit:
    """ASGI middleware: request bodies of at most ``limit`` bytes (see the module docstring).

    ``respond(exc)`` builds the 413 response (the app's error shape)."""

    def __init__(self, app: ASGIApp, *, limit: int,
                 respond: Callable[[BodyTooLarge], Response]) -> None:
        self.app = app
        self.limit = limit
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for k, v in scope.get("headers", ()):
            if k.lower() == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
        if declared is not None and declared > self.limit:
            await self._drain(receive)
            await self.respond(BodyTooLarge(self.limit))(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return msg

        async def watch(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited, watch)
        except BodyTooLarge as exc:  # raised outside a route's body parsing
            if started:
                raise
            await self._drain(receive)
            await self.respond(exc)(scope, receive, send)

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the rest of the body, at most DRAIN_FACTOR x the limit."""
        left = self.limit * DRAIN_FACTOR
        while left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            left -= len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return


def _path(parts: Iterable[str | int]) -> str:
    return ".".join(str(p) for p in parts) or "<body>"


def _check_tree(obj: Any) -> None:
    """Depth and Unicode of a parsed body (iterative: a deep body must not recurse here)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(obj, ())]
    while stack:
        node, where = stack.pop()
        if len(where) > MAX_DEPTH:
            raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels "
                          f"(at {_path(where[:8])}...)", param=None)
        if isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, (*where, k) if k.isascii() else where)
                stack.append((v, (*where, k)))
        elif isinstance(node, list):
            stack.extend((v, (*where, i)) for i, v in enumerate(node))


def _check_text(s: str, where: tuple[str | int, ...]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = s[exc.start]
        raise BadBody(f"invalid parameter {_path(where)!r}: it holds a lone surrogate "
                      f"(\\u{ord(bad):04x} at character {exc.start}); text must be valid "
                      "Unicode", param=_path(where) if where else None) from None


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body as strict UTF-8 JSON and check its depth and strings.

    Raises :class:`BadBody` (400) for invalid UTF-8, too deep a nesting or a lone surrogate,
    and :class:`json.JSONDecodeError` for invalid JSON (FastAPI answers that with 400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadBody(f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at "
                      f"offset {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise BadBody(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check_tree(obj)
    return obj


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body goes through :func:`parse_json_body` (FastAPI's documented
    custom ``Request`` class pattern)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_StrictRequest(request.scope, request.receive))

        return strict_handler


def default_body_limit(backends: Iterable[ModelBackend]) -> int:
    """``server.max_body_bytes`` when unset: from the largest context an in-process model
    accepts (``max_positions`` tokens x 64 bytes + 64 KiB), at least 1 MiB, and 8 MiB when an
    upstream (whose context is not known here) is configured."""
    limit = _MIN_BODY
    for b in backends:
        if b.max_positions:
            limit = max(limit, b.max_positions * _BYTES_PER_TOKEN + _SLACK)
        elif b.kind == "upstream":
            limit = max(limit, _UPSTREAM_BODY)
    return limit
