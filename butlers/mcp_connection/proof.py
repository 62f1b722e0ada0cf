"""Whether the server at a butler's endpoint is that butler, asked before the fleet's token is
sent to it: its `/health?proof=<nonce>` answers `health_proof` of the nonce, which only one
holding the token can compute, for the port it listens on (butlers.http.health_proof).

A port is anyone's once its butler stops: another user of the machine could bind a removed or
stopped butler's port and be sent the operator's token by whatever connected there (a red
team: the gateway connected to every registry row, stale ones too). discover asks it before it
moves a registry row; the gateway before it connects to a butler with the token.
"""

from __future__ import annotations

import hmac
import json
import secrets
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from butlers.http import HEALTH_PORT_PARAM, HEALTH_PROOF_PARAM, health_proof

ANSWER_TIMEOUT_S = 1.5  # for an endpoint's /health
MAX_HEALTH_BYTES = 64 * 1024  # of its answer read (a butler's is under 2 KiB)


async def proven_health(endpoint_url: str, token: str, name: str) -> dict[str, Any] | None:
    """The /health answer of the butler `name` beside `endpoint_url` when it proves it holds
    `token` for that very port (so a process on another port relaying the question gets an
    answer for the wrong port); None when it does not, or cannot be asked."""
    import aiohttp

    parts = urlsplit(endpoint_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    nonce = secrets.token_hex(16)
    # The port it was reached at: a proxy's in front of it is its own too (butlers.daemon).
    query = f"{HEALTH_PROOF_PARAM}={nonce}&{HEALTH_PORT_PARAM}={port}"
    health = urlunsplit((parts.scheme, parts.netloc, "/health", query, ""))
    try:
        timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(health, allow_redirects=False) as response,
        ):
            body = json.loads(await response.content.read(MAX_HEALTH_BYTES))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("name") != name:
        return None
    proof = body.get("proof")
    if not isinstance(proof, str):
        return None
    if not hmac.compare_digest(proof, health_proof(token, name, port, nonce)):
        return None
    return body
