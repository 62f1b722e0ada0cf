"""The environment each kind of child process gets: an allowlist, never the whole of ours.

A butler's own environment holds the Telegram bot token, the mail password, DATABASE_URL and
the MCP auth token. A Claude Code session reads text written by strangers, and a gateway
child is somebody else's program: each gets only what it needs to run.

Each function is given the environment to choose from (`Settings.environ`, or for a child a
library starts, `Settings.inherited_environ()`): this module reads none of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# What any program needs to find its tools, its home, its time zone and its language.
BASE_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TZ", "LANG", "LANGUAGE", "TERM"}
)
BASE_PREFIXES = ("LC_",)

# Claude Code besides: its own settings and credentials, OpenTelemetry (its spans join ours),
# the trace context, and how it reaches the Anthropic API (a proxy, a private CA).
CLAUDE_CODE_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "OTEL_")
CLAUDE_CODE_NAMES = frozenset(
    {
        "TRACEPARENT",
        "TRACESTATE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "NODE_EXTRA_CA_CERTS",
        "XDG_CONFIG_HOME",
        "XDG_CACHE_HOME",
        "XDG_DATA_HOME",
        "XDG_STATE_HOME",
    }
)
# Claude Code on Amazon Bedrock or Google Vertex takes that cloud's credentials, and only then.
CLOUD_PREFIXES = {
    "CLAUDE_CODE_USE_BEDROCK": ("AWS_",),
    "CLAUDE_CODE_USE_VERTEX": ("GOOGLE_", "CLOUD_ML_", "VERTEX_"),
}


def is_base(name: str) -> bool:
    return name in BASE_NAMES or name.startswith(BASE_PREFIXES)


def base_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """PATH, HOME, locale, TZ and the like, from `environ`."""
    return {name: value for name, value in environ.items() if is_base(name)}


def claude_code_keeps(name: str, environ: Mapping[str, str]) -> bool:
    """Whether a Claude Code session may see the variable `name` of `environ` (which also
    says whether Claude Code runs on Bedrock or Vertex)."""
    if is_base(name) or name in CLAUDE_CODE_NAMES or name.startswith(CLAUDE_CODE_PREFIXES):
        return True
    return any(
        environ.get(switch) and name.startswith(prefixes)
        for switch, prefixes in CLOUD_PREFIXES.items()
    )


def gateway_child_environment(
    own: Mapping[str, str], environ: Mapping[str, str], pass_env: Iterable[str] = ()
) -> dict[str, str]:
    """A gateway child (an MCP server from a .mcp.json): the base of `environ` (the gateway's
    Settings.environ), the variables its config names in `pass_env` (a proxy, a CA file:
    named one by one, so that no other of ours leaks), then its declared `env`."""
    passed = {name: environ[name] for name in pass_env if name in environ}
    return {**base_environment(environ), **passed, **own}
