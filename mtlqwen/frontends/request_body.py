"""Reading a request body within bounds: a size limit (413, refused from Content-Length before a byte
is read when it already says so) and one deadline for the whole body (408), so a client that declares
a gigabyte and sends ten bytes holds a connection for the deadline, not for ever.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .api_responses import APIError

if TYPE_CHECKING:  # starlette stays out of `mtlqwen --help` (server.py reads the defaults below)
    from starlette.requests import Request

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a full 256k-token context of text, JSON-escaped, with room to spare
DEFAULT_BODY_TIMEOUT_S = 30.0


def too_large(size: int | str, limit: int) -> APIError:
    return APIError(f"the request body ({size} bytes) is over this server's limit of {limit} bytes "
                    "(--max-body-bytes)", 413, code="body_too_large")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, or APIError 413 / 408 / 400. starlette's ClientDisconnect passes through."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(f"Content-Length must be a byte count, got {declared[:40]!r}")
        if int(declared) > limit:
            raise too_large(declared, limit)

    async def gather() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"over {limit}", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(gather(), timeout)
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s", 408, code="body_timeout") from None
