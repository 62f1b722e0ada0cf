"""Whether the server at a butler's endpoint is that butler, asked before the fleet's token is
sent to it: its `/health?proof=<nonce>` answers `health_proof` of the nonce, which only one
holding the token can compute, for the port it was reached at (`health_proof`; the butler's
side: butlers.daemon).

A port is anyone's once its butler stops: another user of the machine could bind a removed or
stopped butler's port and be sent the operator's token by whatever connected there (a red
team: the gateway connected to every registry row, stale ones too; a review: the CLI, the
gateway's first call and route too, to a switchboard or a butler that was not running).
discover asks it before it moves a registry row; everything that sends the token to a butler
over the network (butlers.mcp_connection.pool, the CLI's client, the gateway's children) asks
it before each new connection (`check_holds_token`), and connects to none that does not prove
it: an impostor there got no token, but was still served to the gateway's host as the butler
(a walkthrough).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
from typing import Any
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 1.5  # for an endpoint's /health
MAX_HEALTH_BYTES = 64 * 1024  # of its answer read (a butler's is under 2 KiB)


# `/health?proof=<nonce>`: a butler with a token adds `health_proof` of the nonce ...
HEALTH_PROOF_PARAM = "proof"
# ... and `&port=<port>`: for the port the asker reached it at, when that is not the one it
# listens on (a reverse proxy's 443 in front of 8100): proven only for a port of its own.
HEALTH_PORT_PARAM = "port"


def health_proof(token: str, name: str, port: int, nonce: str) -> str:
    """What the butler `name` reached on `port` answers to `/health?proof=<nonce>`: only one
    holding the fleet's token can say it, and it names the port, so a process on another
    port that relays the question to the real butler gets an answer for the wrong port."""
    message = f"butlers-health:{name}:{port}:{nonce}".encode()
    return hmac.new(token.encode(), message, "sha256").hexdigest()


class Unproven(Exception):
    """What answers at an address did not prove it holds the fleet's token (str: why)."""


# What to check, said after an Unproven.
UNPROVEN_HINT = (
    "another program on its port, or a butler run with another BUTLERS_AUTH_TOKEN or none: "
    "the token is sent only to one that proves it holds it"
)


async def proven_health(
    endpoint_url: str, token: str, name: str | None = None
) -> dict[str, Any] | None:
    """The /health answer of the butler `name` (None: whichever it says it is) beside
    `endpoint_url` when it proves it holds `token` for that very port (so a process on another
    port relaying the question gets no proof for it); None when it does not, or cannot be
    asked."""
    try:
        return await _proven(endpoint_url, token, name)
    except (Unproven, OSError):
        return None


async def check_holds_token(endpoint_url: str, token: str | None, name: str | None = None) -> None:
    """Before the fleet's token is sent to `endpoint_url`: Unproven, naming why, when what
    answers there does not prove it holds it (another program on a stopped butler's port,
    or a fleet run without this token); OSError when nothing listens there (not connected
    to at all: a program could take the port in between); nothing when it proves it (as the
    butler `name`, when given), or when there is no token to send."""
    if token is not None:
        await _proven(endpoint_url, token, name)


async def _proven(endpoint_url: str, token: str, name: str | None) -> dict[str, Any]:
    """The proven /health answer; Unproven when it is not one (no answer in time counts:
    something took the connection); OSError when nothing listens there."""
    import aiohttp

    parts = urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OSError(f"{endpoint_url!r} is not an http(s) URL")  # never connected to
    port = parts.port or (443 if parts.scheme == "https" else 80)
    nonce = secrets.token_hex(16)
    # The port it was reached at: a proxy's in front of it is its own too (butlers.daemon).
    query = f"{HEALTH_PROOF_PARAM}={nonce}&{HEALTH_PORT_PARAM}={port}"
    health = urlunsplit((parts.scheme, parts.netloc, "/health", query, ""))
    where = _where(endpoint_url)
    try:
        timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(health, allow_redirects=False) as response,
        ):
            body = json.loads(await response.content.read(MAX_HEALTH_BYTES))
    except aiohttp.ClientConnectorError as exc:
        raise OSError(f"{where}: {exc.os_error.strerror or exc}") from exc  # nothing listens
    except TimeoutError as exc:
        raise Unproven(f"{where} did not answer /health within {ANSWER_TIMEOUT_S:g} s") from exc
    except (aiohttp.ClientError, ValueError) as exc:
        raise Unproven(f"{where} answered /health with no butler's answer") from exc
    if not isinstance(body, dict) or (name is not None and body.get("name") != name):
        raise Unproven(f"{where} does not answer /health as {name or 'a butler'}")
    said, proof = body.get("name"), body.get("proof")
    if not isinstance(said, str) or not isinstance(proof, str):
        raise Unproven(f"{where} answered /health with no proof of BUTLERS_AUTH_TOKEN")
    if not hmac.compare_digest(proof, health_proof(token, said, port, nonce)):
        raise Unproven(f"{where} answered /health with a proof of another token")
    return body


def _where(url: str) -> str:
    """A URL as scheme, host and port: its path or query may hold a credential."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/…"
