"""Every exception class of the package. Third-party errors are wrapped where they enter.

Exception
├── ButlersError               every error we raise on purpose
│   ├── ConfigError            a config file is malformed: file, key, what was expected
│   ├── DatabaseError          PostgreSQL could not be started, reached, created, migrated
│   ├── SpawnError             a Claude Code session could not run, or ran without its tools
│   │   ├── OutOfTurns         it took all its turns ([runtime] max_turns) and did not finish
│   │   └── WrapperFailed      a gateway `natural_language` session did not answer
│   ├── CommandError           a `butlers` command cannot go on (exit 1, no traceback)
│   ├── InvalidChild           (also a ValueError) a `.mcp.json` the gateway skips
│   ├── McpCallError           a request to another MCP server got no result
│   │   ├── ConnectionClosed   not sent: safe to send again on a new connection
│   │   │   └── AnswerLost     sent, then the connection went: may have run
│   │   ├── CallTimedOut       sent, no answer in time (the peer was told to stop)
│   │   └── RemoteError        the peer answered with a JSON-RPC error
│   ├── TargetUnreachable      the switchboard's connection to a target failed or broke
│   ├── RouteError             a route with no successful answer; `kind` picks the reply
│   │   ├── RouteRefused       not a routable butler (kind refused)
│   │   ├── RoutePolicyError   a classification session's route it may not make (refused)
│   │   ├── TargetDown         the target could not be reached (kind unreachable)
│   │   ├── TargetSlow         the target did not answer in time (kind timeout)
│   │   ├── TargetBusy         its session failed before acting, for a reason that passes (busy)
│   │   └── TargetOutOfTurns   the target's session took all its turns (out_of_turns)
│   ├── NotifyFailed           a butler's `notify`: the switchboard did not take it
│   ├── NotifyRefused          the switchboard's `deliver`: a notification it will not send
│   ├── DeliveryError          a channel did not take an outbox row (`permanent` or not)
│   │   └── RecipientDeferred  not now, for this recipient only (a mail server's 4xx)
│   ├── TranscriptionFailed    a voice note did not become text (`transient` or not)
│   ├── AttachmentRefused      a file a message carried is not read (the text says why)
│   ├── LeaseLost              another switchboard process took over a message
│   ├── TokenRejected          Telegram refused a bot token (init asks for another)
│   └── MailError              sending or fetching mail failed (host:port in the message)
│       ├── MailRefused        will not work until someone acts (certificate, login)
│       └── MailUnreadable     a mail or webhook body we will not read
│           └── HeaderTooLong  one header over the limit, refused unparsed
├── KeyProblem (ValueError)    a config model's validator names one key; pydantic makes it
│                              part of a ValidationError, config_errors a ConfigError
└── NotRegularFile (OSError)   a file of ours to read is a FIFO, a device...: not a regular
                               file (butlers.files; its callers say what to do)

Two ValueErrors stay beside the parser that raises them and the one caller that catches
them, never crossing a module: BadTime (butlers.schedule_time: a schedule's `at`) and
BadFilter (butlers.dashboard.app: a query string the dashboard answers with 400).

fastmcp.exceptions.ToolError
└── ToolRefusal                the tool-answer class: a message for the caller instead of
                               a result. It lives in butlers.tool_errors, kept apart because
                               it subclasses FastMCP's ToolError and importing FastMCP takes
                               seconds: this module imports nothing heavy (`butlers --help`
                               and every ConfigError import it; tests/test_cli.py guards it).
"""

from __future__ import annotations

from pathlib import Path


class ButlersError(Exception):
    """Base class of every error this package raises on purpose."""


class LeaseLost(ButlersError):
    """This switchboard process's claim on a message ended: another process took it over
    (butlers.switchboard.worker), and its outcome is the one that counts."""


class AttachmentRefused(ButlersError):
    """A file a message carried is not read (butlers.media): the text says why, in words for
    the sender (which limit, which file); nothing of it is stored."""


class ConfigError(ButlersError):
    """A butler.toml is malformed: names the file, the key and what was expected."""

    def __init__(self, path: Path | str, key: str | None, problem: str) -> None:
        self.path = Path(path)
        self.key = key
        self.problem = problem
        where = f"{self.path}: {key}: " if key else f"{self.path}: "
        super().__init__(where + problem)


class DatabaseError(ButlersError):
    """The PostgreSQL server could not be started, reached, created or migrated."""


class SchemaTooNew(DatabaseError):
    """A database a newer butlers migrated: this build is older than its data (a rollback)."""


class SpawnError(ButlersError):
    """A Claude Code session could not run, or ran without its tools. `cost_usd`: what a
    session that did run spent before it failed (Claude Code reports it in its error result):
    a failed session costs money too, and the daily spend cap must count it."""

    def __init__(self, message: str, *, cost_usd: float | None = None) -> None:
        super().__init__(message)
        self.cost_usd = cost_usd


# How a session that took all its turns is said, first in its error text: `trigger` passes
# the text on after "session <id> failed: ", and route knows the failure by it (the reply a
# person gets says to ask what was done, not to try again).
OUT_OF_TURNS = "ran out of turns"


class OutOfTurns(SpawnError):
    """A session took all of its turns ([runtime] max_turns) without finishing. What it did
    with its tools on the way is done: trying again whole may do it twice."""

    def __init__(self, max_turns: int, *, cost_usd: float | None = None) -> None:
        super().__init__(
            f"{OUT_OF_TURNS}: the session took all {max_turns} of its turns ([runtime] "
            "max_turns) before it finished; what its tools did on the way is done",
            cost_usd=cost_usd,
        )


class McpCallError(ButlersError):
    """A request we sent to another MCP server got no result (butlers.mcp_connection).

    route, notify and the gateway catch this family; which subclass says whether sending the
    request again elsewhere is safe. Each message is written for the person or model who
    will read it, by whoever knows most about the call (the connection, or its owner).
    """


class ConnectionClosed(McpCallError):
    """The connection is gone, or never opened. Raised as itself, the request was not sent:
    sending it again on a new connection cannot run anything twice (AnswerLost: it was)."""


class AnswerLost(ConnectionClosed):
    """The request was sent, then the connection went away before its answer: the tool may
    or may not have run, so it must not be sent again blindly."""


class CallTimedOut(McpCallError):
    """The peer took the request but sent no answer within the timeout (we told it to stop:
    `notifications/cancelled`)."""


class RemoteError(McpCallError):
    """The peer answered with a JSON-RPC error (a tool's own error is a result, not this)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CommandError(ButlersError):
    """A command cannot go on; printed without a traceback, exit status 1."""


class TokenRejected(ButlersError):
    """Telegram answered a bot token with Unauthorized: `init` asks for another one."""


class BotApiUnreachable(CommandError):
    """The Bot API did not answer `init`'s getMe: it asks for the chat id instead."""


class InvalidChild(ButlersError, ValueError):
    """A `.mcp.json` that is not a child the gateway can run; the message says which key is
    wrong and how. The gateway skips the file with a warning."""


class TargetUnreachable(ButlersError):
    """The target's endpoint refused, dropped or never answered the connection."""


class RouteError(ButlersError):
    """A route that did not reach a successful answer. The message is for the caller of
    `route` and the logs; people get a fixed sentence chosen by `kind` (butlers.switchboard.
    replies), never this text: it names endpoints and the target's own errors."""

    kind = "failed"  # the target ran the tool and answered with an error


class RouteRefused(RouteError):
    """Refused before any connection: not a routable butler, or not allowed to this caller."""

    kind = "refused"


class RoutePolicyError(RouteError):
    """A classification session asked for a route it may not make; the text is for the model."""

    kind = "refused"


class TargetDown(RouteError):
    """The target could not be reached, or the connection broke before it answered."""

    kind = "unreachable"


class TargetSlow(RouteError):
    """The target took the call but did not answer within the route timeout."""

    kind = "timeout"


class TargetBusy(RouteError):
    """The target's session failed before it did anything, for a reason that passes (the
    Messages API overloaded or rate-limiting, the machine out of disk or memory): its
    `trigger` said so ("failed before acting"). The message may be tried again later."""

    kind = "busy"


class TargetOutOfTurns(RouteError):
    """The target's session took all its turns without finishing (its `trigger` said so:
    OUT_OF_TURNS); some of the work may be done."""

    kind = "out_of_turns"


class NotifyFailed(ButlersError):
    """The switchboard did not take the notification; the message says why. `refused`: the
    switchboard answered, refusing it (and logged that itself), rather than failing."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class NotifyRefused(ButlersError):
    """A notification that cannot go out; the message says why, for the butler's model."""


class DeliveryError(ButlersError):
    """The channel did not take a message. `permanent`: it never will (a chat that does not
    exist, an address the server refuses); otherwise it is tried again later."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class TranscriptionFailed(ButlersError):
    """A voice note did not become text (butlers.switchboard.transcription).

    `transient`: the service may well take it later (it answered 5xx or 429, did not answer in
    time, or could not be reached): the worker keeps the message and tries again. Otherwise
    trying again changes nothing until someone acts (a refused key, a file the service will not
    read, an answer without text, no local model). `status`: the HTTP status the service
    answered, None when none came. The message names the service and what it said, never its
    key: it is logged, and the key is in no log."""

    def __init__(
        self, message: str, *, transient: bool, status: int | None = None, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.transient = transient
        self.status = status
        # The service did not answer in time: for one file, again and again, it is too long
        # for `timeout_s` rather than a service that is down (butlers.switchboard.attachments).
        self.timed_out = timed_out


class MailError(ButlersError):
    """Sending or fetching mail failed; the message says what and where (host:port)."""


class MailRefused(MailError):
    """A failure that retrying will not fix until someone acts: an untrusted certificate,
    STARTTLS not offered, a refused login."""


class MailUnreadable(MailError):
    """A mail (or webhook body) we will not read: too big, a header too long, too many MIME
    parts, or not the JSON we take. The message says what and how big."""


class HeaderTooLong(MailUnreadable):
    """One header longer than `limit` bytes, refused without parsing it."""

    def __init__(self, name: str, size: int, limit: int) -> None:
        super().__init__(f"the {name} header is {size} bytes long, over the limit of {limit}")


class KeyProblem(ValueError):
    """Raised by a config model's validator about one of its keys (not the table as a whole),
    so the message names that key: `raise KeyProblem("webhook_url", "is only used with ...")`.
    A ValueError, not a ButlersError: pydantic collects it into its ValidationError, which
    butlers.config_errors turns into a ConfigError."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key
        self.problem = problem


class WrapperFailed(SpawnError):
    """A gateway `natural_language` session that did not answer (butlers.gateway.wrapper):
    the message says which child and why (no credentials, a timeout, the child did not
    connect)."""


class RecipientDeferred(DeliveryError):
    """The channel did not take a row, for its recipient only and for now (a mail server's
    4xx to RCPT TO): tried again with the backoff, while the channel's rows to others go on."""


class NotRegularFile(OSError):
    """What butlers.files.read_regular was to read is a FIFO, a device, a directory...:
    anything but a regular file. An OSError, as the other failures of opening it are."""
