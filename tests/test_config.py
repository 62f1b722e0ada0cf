"""butler.toml loading: typed values, and errors that name the file, the key and what was
expected; a broken butler is skipped while the rest load."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from butlers.config import Placement, load_butler_config, load_config_dir
from butlers.errors import ButlersError, ConfigError

SHIPPED = Path(__file__).resolve().parent.parent / "config" / "butlers"


def write(root: Path, name: str, text: str) -> Path:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "butler.toml"
    path.write_text(text)
    return path


def test_shipped_config_loads_four_butlers_on_8100_to_8103() -> None:
    fleet = load_config_dir(SHIPPED)
    assert fleet.errors == ()
    by_name = {b.name: b for b in fleet.butlers}
    assert {n: b.port for n, b in by_name.items()} == {
        "switchboard": 8100,
        "general": 8101,
        "relationship": 8102,
        "health": 8103,
    }
    for butler in fleet.butlers:
        assert butler.description, butler.name
        assert butler.instructions and butler.instructions.startswith("#"), butler.name
        assert butler.endpoint_url == f"http://127.0.0.1:{butler.port}/sse"
        assert butler.database == f"butler_{butler.name}"
    assert by_name["switchboard"].modules == ["telegram", "email"]
    assert by_name["switchboard"].telegram.allowed_chat_ids == ()


def test_full_config_is_typed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "health",
        """
[butler]
name = "health"
description = "Health things."
port = 8103
host = "0.0.0.0"
endpoint_url = "http://health:8103/sse"

[butler.db]
name = "health_db"

[runtime]
model = "sonnet"
max_turns = 5
timeout_s = 30
max_concurrent_sessions = 2

[modules.telegram]
allowed_chat_ids = [12345, "67890"]

[[switchboard.triage]]
channel = "email"
sender = "@school.example"
pattern = "(?i)invoice"
butler = "finance"
""",
    )
    config = load_butler_config(path)
    assert config.host == "0.0.0.0"
    assert config.endpoint_url == "http://health:8103/sse"
    assert config.database == "health_db"
    assert (config.runtime.model, config.runtime.max_turns, config.runtime.timeout_s) == (
        "sonnet",
        5,
        30.0,
    )
    assert config.runtime.max_concurrent_sessions == 2
    assert config.telegram.allowed_chat_ids == ("12345", "67890")
    assert config.telegram.mode == "polling"
    [rule] = config.triage
    assert rule.butler == "finance" and rule.pattern.search("Your INVOICE")


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[butler\nname=", None, "is not valid TOML"),
        ("[butler]\nport = 8000\n", "butler.name", "is required"),
        ('[butler]\nname = "x"\n', "butler.port", "is required"),
        (
            '[butler]\nname = "x"\nport = "80"\n',
            "butler.port",
            "expected a port number between 1 and 65535, got '80'",
        ),
        (
            '[butler]\nname = "x"\nport = true\n',
            "butler.port",
            "expected a port number between 1 and 65535, got True",
        ),
        ('[butler]\nname = "x"\nport = 70000\n', "butler.port", "between 1 and 65535"),
        ('[butler]\nname = "x"\nport = 1\ncolour = "red"\n', "butler.colour", "unknown key"),
        (
            '[butler]\nname = "x"\nport = 1\n[runtime]\nmax_turn = 3\n',
            "runtime.max_turn",
            "unknown key",
        ),
        (
            '[butler]\nname = "x"\nport = 1\n[runtime]\nmax_turns = 0\n',
            "runtime.max_turns",
            "positive",
        ),
        ('[butler]\nname = "x"\nport = 1\n[extra]\n', "extra", "unknown key"),
        ('[butler]\nname = "x"\nport = 1\n[modules.fax]\n', "modules.fax", "unknown module"),
        (
            '[butler]\nname = "x"\nport = 1\n[modules.telegram]\nmode = "push"\n',
            "modules.telegram.mode",
            "expected one of 'polling', 'webhook'",
        ),
        (
            '[butler]\nname = "x"\nport = 1\n[modules.email]\nallowed_senders = [1.5]\n',
            "modules.email.allowed_senders",
            "list of strings",
        ),
        (
            '[butler]\nname = "x"\nport = 1\n[[switchboard.triage]]\npattern = "("\nbutler = "g"\n',
            "switchboard.triage[0].pattern",
            "invalid regular expression",
        ),
        (
            '[butler]\nname = "x"\nport = 1\n'
            '[[switchboard.triage]]\nchannel = "sms"\nbutler = "g"\n',
            "switchboard.triage[0].channel",
            "expected one of",
        ),
        (
            '[butler]\nname = "Bad Name"\nport = 1\n',
            "butler.name",
            "expected a name such as 'health' ([a-z][a-z0-9_-]*), got 'Bad Name'",
        ),
        ('[butler]\nname = "y"\nport = 1\n', "butler.name", "must match its directory name 'x'"),
    ],
)
def test_errors_name_file_key_and_expectation(tmp_path: Path, text: str, key, problem) -> None:
    path = write(tmp_path, "x", text)
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    error = excinfo.value
    assert error.path == path
    assert error.key == key
    assert problem in error.problem
    assert str(path) in str(error)


def test_broken_butler_is_skipped_and_the_rest_load(tmp_path: Path) -> None:
    write(tmp_path, "good", '[butler]\nname = "good"\nport = 9001\n')
    write(tmp_path, "broken", '[butler]\nname = "broken"\nport = "nope"\n')
    write(tmp_path, "also", '[butler]\nname = "also"\nport = 9002\n')
    (tmp_path / "not-a-butler").mkdir()  # no butler.toml: ignored, not an error
    fleet = load_config_dir(tmp_path)
    assert [b.name for b in fleet.butlers] == ["also", "good"]
    [error] = fleet.errors
    assert error.path == tmp_path / "broken" / "butler.toml" and error.key == "butler.port"


def test_duplicate_port_skips_the_second_butler(tmp_path: Path) -> None:
    write(tmp_path, "alpha", '[butler]\nname = "alpha"\nport = 9001\n')
    write(tmp_path, "beta", '[butler]\nname = "beta"\nport = 9001\n')
    fleet = load_config_dir(tmp_path)
    assert [b.name for b in fleet.butlers] == ["alpha"]
    [error] = fleet.errors
    assert error.key == "butler.port" and "already used by 'alpha'" in error.problem


def test_missing_config_dir_is_an_error_not_a_crash(tmp_path: Path) -> None:
    fleet = load_config_dir(tmp_path / "nowhere")
    assert fleet.butlers == ()
    assert "does not exist" in str(fleet.errors[0])


def test_non_utf8_file(tmp_path: Path) -> None:
    directory = tmp_path / "x"
    directory.mkdir()
    (directory / "butler.toml").write_bytes(b'[butler]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_butler_config(directory / "butler.toml")


def test_placement_from_the_environment_fills_what_butler_toml_leaves_out(
    tmp_path: Path,
) -> None:
    """What docker compose does: bind every interface, register service-name endpoints. The
    environment is handed in (this module reads none)."""
    write(tmp_path, "general", '[butler]\nname = "general"\nport = 8101\n')
    write(
        tmp_path,
        "health",
        '[butler]\nname = "health"\nport = 8103\nhost = "127.0.0.2"\n'
        'endpoint_url = "http://health.lan:8103/sse"\n',
    )
    environ = {
        "BUTLERS_HOST": "0.0.0.0",
        "BUTLERS_ENDPOINT_URL_TEMPLATE": "http://{name}:{port}/sse",
    }
    fleet = load_config_dir(tmp_path, Placement.from_environment(environ))
    general, health = fleet.get("general"), fleet.get("health")
    assert (general.host, general.endpoint_url) == ("0.0.0.0", "http://general:8101/sse")
    assert (health.host, health.endpoint_url) == ("127.0.0.2", "http://health.lan:8103/sse")
    # Nothing handed in: loopback, whatever this process's environment says.
    assert load_config_dir(tmp_path).get("general").endpoint_url == "http://127.0.0.1:8101/sse"

    environ["BUTLERS_ENDPOINT_URL_TEMPLATE"] = "http://{service}:{port}/sse"
    with pytest.raises(ButlersError, match=r"_TEMPLATE=.*\{name\} and \{port\}"):
        Placement.from_environment(environ)
    environ["BUTLERS_ENDPOINT_URL_TEMPLATE"] = "{name}:{port}"
    with pytest.raises(ButlersError, match="expected an http"):
        Placement.from_environment(environ)


def test_switchboard_limits_and_tls_choices(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "switchboard",
        """
[butler]
name = "switchboard"
port = 8100

[switchboard]
default_butler = "home"
max_routes_per_message = 2
max_messages_per_sender_per_hour = 0
retention_days = 7
max_request_bytes = 65536

[modules.telegram]
mode = "webhook"
webhook_url = "https://bot.example.com/telegram/webhook"

[modules.email]
imap_starttls = true
smtp_ssl = true
require_authentication_results = " mx.example.com "
""",
    )
    config = load_butler_config(path)
    limits = config.switchboard
    assert (limits.default_butler, limits.max_routes_per_message) == ("home", 2)
    assert (limits.max_messages_per_sender_per_hour, limits.retention_days) == (0, 7)
    assert limits.max_request_bytes == 65536
    assert config.telegram.webhook_url == "https://bot.example.com/telegram/webhook"
    email = config.email
    # Choosing STARTTLS turns implicit TLS's default off, and the other way round.
    assert (email.imap_ssl, email.imap_starttls) == (False, True)
    assert (email.smtp_ssl, email.smtp_starttls) == (True, False)
    assert email.require_authentication_results == "mx.example.com"
    # No [switchboard] table: not the switchboard.
    plain = load_butler_config(write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n'))
    assert plain.switchboard is None and not plain.is_switchboard
    # An empty one: the switchboard, with the defaults.
    front = load_butler_config(
        write(tmp_path, "y", '[butler]\nname = "y"\nport = 1\n[switchboard]\n')
    )
    assert front.is_switchboard and front.switchboard.max_routes_per_message == 3
    assert front.switchboard.max_request_bytes == 1024 * 1024
    assert front.switchboard.default_butler == "general"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        (
            "[modules.email]\nimap_ssl = true\nimap_starttls = true\n",
            "modules.email.imap_starttls",
            "choose one of imap_ssl",
        ),
        (
            "[modules.email]\nsmtp_ssl = true\nsmtp_starttls = true\n",
            "modules.email.smtp_starttls",
            "choose one of smtp_ssl",
        ),
        (
            '[modules.telegram]\nmode = "webhook"\nwebhook_url = "http://x.example/hook"\n',
            "modules.telegram.webhook_url",
            "https://",
        ),
        (
            '[modules.telegram]\nwebhook_url = "https://x.example/hook"\n',
            "modules.telegram.webhook_url",
            'mode = "webhook"',
        ),
        (
            "[switchboard]\nmax_routes_per_message = 0\n",
            "switchboard.max_routes_per_message",
            ">= 1",
        ),
        ("[switchboard]\nretention = 5\n", "switchboard.retention", "unknown key"),
        (
            '[switchboard]\ndefault_butler = "Gen eral"\n',
            "switchboard.default_butler",
            "expected a name such as 'health'",
        ),
    ],
)
def test_new_keys_name_their_errors(tmp_path: Path, text: str, key: str, problem: str) -> None:
    path = write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n' + text)
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    assert (excinfo.value.key, excinfo.value.path) == (key, path)
    assert problem in excinfo.value.problem


def test_conversation_delivery_and_owner_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "switchboard",
        """
[butler]
name = "switchboard"
port = 8100
switchboard_url = "http://127.0.0.1:8100/sse"

[switchboard]
context_messages = 0
thread_affinity_days = 7
reply_retry_hours = 0.5
max_notifications_per_hour = 5

[switchboard.owner]
telegram_chat_id = 12345
email = "me@example.com"
prefer = "email"
""",
    )
    config = load_butler_config(path)
    limits = config.switchboard
    assert (limits.context_messages, limits.thread_affinity_days) == (0, 7)
    assert (limits.reply_retry_hours, limits.max_notifications_per_hour) == (0.5, 5)
    assert limits.owner.channels() == [("email", "me@example.com"), ("telegram", "12345")]
    assert config.switchboard_url == "http://127.0.0.1:8100/sse"
    plain = load_butler_config(write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n'))
    assert plain.switchboard is None and plain.switchboard_url is None
    owner_only = load_butler_config(
        write(tmp_path, "y", '[butler]\nname = "y"\nport = 1\n[switchboard.owner]\n')
    )
    assert owner_only.is_switchboard and owner_only.switchboard.owner.channels() == []


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ('[switchboard.owner]\nemail = "me"\n', "switchboard.owner.email", "email address"),
        ('[switchboard.owner]\nprefer = "sms"\n', "switchboard.owner.prefer", "expected one of"),
        ("[switchboard.owner]\nphone = 1\n", "switchboard.owner.phone", "unknown key"),
        ("[switchboard]\nreply_retry_hours = 0\n", "switchboard.reply_retry_hours", "positive"),
        ("[switchboard]\ncontext_messages = -1\n", "switchboard.context_messages", ">= 0"),
    ],
)
def test_owner_and_delivery_errors(tmp_path: Path, text: str, key: str, problem: str) -> None:
    path = write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n' + text)
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    assert (excinfo.value.key, problem in excinfo.value.problem) == (key, True)


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[runtime]\nmax_turn = 3\n", "runtime.max_turn", "did you mean 'max_turns'?"),
        ("[modules.emial]\n", "modules.emial", "unknown module, did you mean 'email'?"),
        ("[switchboard]\nretention = 5\n", "switchboard.retention", "'retention_days'?"),
        ("[swtichboard]\n", "swtichboard", "unknown key, did you mean 'switchboard'?"),
        (
            "[butler.db]\ncolour = 1\n",
            "butler.db.colour",
            "unknown key, expected one of: name",  # nothing close: what there is
        ),
    ],
)
def test_unknown_keys_suggest_the_key_meant(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n' + text)
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    assert excinfo.value.key == key
    assert problem in excinfo.value.problem, excinfo.value.problem


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "x",
        '[butler]\nname = "x"\nport = 1\n[runtime]\nmax_turns = 0\ntimeout = 3\n'
        '[modules.telegram]\nmode = "push"\n',
    )
    with pytest.raises(ConfigError) as excinfo:
        load_butler_config(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: runtime.max_turns: expected a positive integer, got 0")
    assert "runtime.timeout: unknown key, did you mean 'timeout_s'?" in message
    assert "modules.telegram.mode: expected one of 'polling', 'webhook', got 'push'" in message


def test_shipped_switchboard_is_the_one_with_a_switchboard_table() -> None:
    fleet = load_config_dir(SHIPPED)
    assert fleet.switchboard is fleet.get("switchboard")
    assert [b.name for b in fleet.butlers if b.is_switchboard] == ["switchboard"]
    assert fleet.switchboard.switchboard.default_butler == "general"


def test_the_switchboard_is_found_by_its_table_not_its_name(tmp_path: Path) -> None:
    write(tmp_path, "frontdoor", '[butler]\nname = "frontdoor"\nport = 9100\n[switchboard]\n')
    write(tmp_path, "general", '[butler]\nname = "general"\nport = 9101\n')
    write(tmp_path, "switchboard", '[butler]\nname = "switchboard"\nport = 9102\n')
    fleet = load_config_dir(tmp_path)
    assert fleet.errors == ()
    assert fleet.switchboard is fleet.get("frontdoor")
    assert not fleet.get("switchboard").is_switchboard


def test_a_default_butler_that_is_not_in_the_config_dir_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "frontdoor",
        '[butler]\nname = "frontdoor"\nport = 9100\n[switchboard]\ndefault_butler = "helper"\n',
    )
    write(tmp_path, "general", '[butler]\nname = "general"\nport = 9101\n')
    fleet = load_config_dir(tmp_path)
    assert [b.name for b in fleet.butlers] == ["general"]
    [error] = fleet.errors
    assert (error.path, error.key) == (path, "switchboard.default_butler")
    assert f"default_butler 'helper' is not a butler of {tmp_path}" in str(error)
    assert "(its butlers: general)" in error.problem

    # The default: general, which must be there too.
    (tmp_path / "general" / "butler.toml").unlink()
    path.write_text('[butler]\nname = "frontdoor"\nport = 9100\n[switchboard]\n')
    [error] = load_config_dir(tmp_path).errors
    assert f"default_butler 'general' is not a butler of {tmp_path}" in str(error)

    # A butler of the directory that is broken still counts: it may be fixed, or run elsewhere.
    write(tmp_path, "general", '[butler]\nname = "general"\nport = "nope"\n')
    fleet = load_config_dir(tmp_path)
    assert fleet.switchboard is fleet.get("frontdoor")
    assert [e.key for e in fleet.errors] == ["butler.port"]


def test_the_switchboard_cannot_be_its_own_default(tmp_path: Path) -> None:
    write(
        tmp_path,
        "frontdoor",
        '[butler]\nname = "frontdoor"\nport = 9100\n[switchboard]\ndefault_butler = "frontdoor"\n',
    )
    [error] = load_config_dir(tmp_path).errors
    assert error.key == "switchboard.default_butler" and "the switchboard itself" in error.problem


def test_a_second_switchboard_in_one_config_dir_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "general", '[butler]\nname = "general"\nport = 9101\n')
    write(tmp_path, "alpha", '[butler]\nname = "alpha"\nport = 9100\n[switchboard]\n')
    second = write(tmp_path, "beta", '[butler]\nname = "beta"\nport = 9102\n[switchboard.owner]\n')
    fleet = load_config_dir(tmp_path)
    assert fleet.switchboard is fleet.get("alpha") and fleet.get("beta") is None
    [error] = fleet.errors
    assert (error.path, error.key) == (second, "switchboard")
    assert f"'alpha' is already the switchboard of {tmp_path}" in error.problem


@pytest.mark.parametrize("module", ["telegram", "email"])
def test_a_channel_module_outside_the_switchboard_is_refused(tmp_path: Path, module: str) -> None:
    """Guards ButlerFile._channels_on_the_switchboard: send_message / send_email send to
    anyone, so only the butler with a [switchboard] table may have a channel module; the
    butler that declares one elsewhere is skipped, the others load."""
    write(
        tmp_path,
        "frontdoor",
        f'[butler]\nname = "frontdoor"\nport = 9100\n[switchboard]\n[modules.{module}]\n',
    )
    path = write(
        tmp_path, "general", f'[butler]\nname = "general"\nport = 9101\n[modules.{module}]\n'
    )
    write(tmp_path, "health", '[butler]\nname = "health"\nport = 9102\n')
    fleet = load_config_dir(tmp_path)
    assert [b.name for b in fleet.butlers] == ["frontdoor", "health"]
    assert fleet.get("frontdoor").modules == [module]
    [error] = fleet.errors
    assert (error.path, error.key) == (path, f"modules.{module}")
    assert "runs only on the switchboard (the butler with a [switchboard] table)" in error.problem
    assert str(error).startswith(f"{path}: modules.{module}: ")
    # The schema an editor checks the file with says so too.
    schema = json.loads((SHIPPED.parent.parent / "schemas" / "butler.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match="'switchboard' is a required property"):
        jsonschema.validate(tomllib.loads(path.read_text()), schema)
    jsonschema.validate(tomllib.loads((tmp_path / "frontdoor" / "butler.toml").read_text()), schema)


def test_flood_limits_are_runtime_keys(tmp_path: Path) -> None:
    """[runtime] min_schedule_interval_s, max_scheduled_runs_per_hour, max_spend_usd_per_day:
    their defaults, their values, and errors naming them."""
    plain = load_butler_config(write(tmp_path, "x", '[butler]\nname = "x"\nport = 1\n'))
    runtime = plain.runtime
    assert (runtime.min_schedule_interval_s, runtime.max_scheduled_runs_per_hour) == (300, 30)
    assert runtime.max_spend_usd_per_day == 0
    path = write(
        tmp_path,
        "x",
        '[butler]\nname = "x"\nport = 1\n[runtime]\nmin_schedule_interval_s = 60\n'
        "max_scheduled_runs_per_hour = 0\nmax_spend_usd_per_day = 2\n",
    )
    runtime = load_butler_config(path).runtime
    assert (runtime.min_schedule_interval_s, runtime.max_scheduled_runs_per_hour) == (60, 0)
    assert runtime.max_spend_usd_per_day == 2.0
    for key, value, problem in [
        ("min_schedule_interval_s", "-1", "expected an integer >= 0, got -1"),
        ("max_scheduled_runs_per_hour", "1.5", "expected an integer >= 0, got 1.5"),
        (
            "max_spend_usd_per_day",
            '"5"',
            "expected a number >= 0, got '5', a string: write it without the quotes",
        ),
    ]:
        path.write_text(f'[butler]\nname = "x"\nport = 1\n[runtime]\n{key} = {value}\n')
        with pytest.raises(ConfigError) as excinfo:
            load_butler_config(path)
        assert (excinfo.value.key, excinfo.value.problem) == (f"runtime.{key}", problem)


def test_time_zones_schedules_memory_and_approvals_come_from_the_file(tmp_path: Path) -> None:
    write(
        tmp_path,
        "switchboard",
        """
[butler]
name = "switchboard"
port = 8100
[switchboard]
[switchboard.owner]
timezone = "Asia/Tokyo"
""",
    )
    write(
        tmp_path,
        "general",
        """
[butler]
name = "general"
port = 8101
[runtime]
catch_up_hours = 2
memory_context = 3
memory_language = "german"
[approvals]
tools = ["notify"]
[[schedules]]
name = "morning-brief"
cron = "0 8 * * *"
prompt = "Summarise today."
""",
    )
    write(
        tmp_path,
        "health",
        '[butler]\nname = "health"\nport = 8103\ntimezone = "Europe/Berlin"\n',
    )
    fleet = load_config_dir(tmp_path)
    assert fleet.errors == ()
    general, health = fleet.get("general"), fleet.get("health")
    assert general is not None and health is not None
    assert general.zone == "Asia/Tokyo"  # the owner's
    assert health.zone == "Europe/Berlin"  # its own
    assert fleet.switchboard is not None and fleet.switchboard.zone == "Asia/Tokyo"
    assert [(s.name, s.cron) for s in general.schedules] == [("morning-brief", "0 8 * * *")]
    assert general.runtime.catch_up_hours == 2 and general.runtime.memory_context == 3
    assert general.approvals.tools == ("notify",)
    assert general.needs_approval("notify") and not health.needs_approval("notify")
    # Without a switchboard in the directory: UTC.
    alone = load_butler_config(tmp_path / "general" / "butler.toml")
    assert alone.zone == "UTC"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ('timezone = "Mars/Olympus"', "butler.timezone", "unknown time zone 'Mars/Olympus'"),
        ('timezone = "localtime"', "butler.timezone", "unknown time zone 'localtime'"),
        (
            'timezone = "europe/berlin"',
            "butler.timezone",
            "unknown time zone 'europe/berlin': an IANA name such as 'Europe/Berlin' or 'UTC'; "
            "did you mean 'Europe/Berlin'?",
        ),
        (
            '[[schedules]]\nname = "a"\ncron = "every day"\nprompt = "x"',
            "schedules[0].cron",
            "is not a cron expression",
        ),
        (
            '[[schedules]]\nname = "a"\ncron = "0 25 * * *"\nprompt = "x"',
            "schedules[0].cron",
            "'0 25 * * *' is not a cron expression: its hour '25' is not valid: it takes 0-23",
        ),
        (
            '[[schedules]]\nname = "leap"\ncron = "0 9 30 2 *"\nprompt = "x"',
            "schedules[0].cron",
            "'0 9 30 2 *' is not a cron expression: it never comes round (no such date)",
        ),
        (
            '[[schedules]]\nname = "a"\ncron = "@daily"\nprompt = "x"\n'
            '[[schedules]]\nname = "a"\ncron = "@hourly"\nprompt = "y"',
            "schedules[1].name",
            "already declared",
        ),
        (
            '[[schedules]]\nname = "a"\ncron = "@daily"\nprompt = ""',
            "schedules[0].prompt",
            "",
        ),
    ],
)
def test_time_and_schedule_errors_name_the_key(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    head, _, tables = text.partition("[[")
    body = f'[butler]\nname = "general"\nport = 8101\n{head}\n' + (f"[[{tables}" if tables else "")
    path = write(tmp_path, "general", body)
    with pytest.raises(ConfigError) as info:
        load_butler_config(path)
    assert key in str(info.value) and problem in str(info.value)


@pytest.mark.parametrize(
    ("host", "reached"),
    [
        ("localhost", "127.0.0.1"),
        ("LOCALHOST", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("::", "127.0.0.1"),
        ("127.0.0.2", "127.0.0.2"),
        ("192.0.2.7", "192.0.2.7"),
    ],
)
def test_a_butler_is_registered_where_it_binds(tmp_path: Path, host: str, reached: str) -> None:
    """`localhost` binds 127.0.0.1 (an IPv4 socket), so it is registered so: a client that
    resolves `localhost` to ::1 first reached whoever listened there on the same port, which
    could prove itself through the butler's /health and be sent the token (a red team)."""
    path = write(tmp_path, "health", f'[butler]\nname = "health"\nport = 8103\nhost = "{host}"\n')
    config = load_butler_config(path)
    assert config.endpoint_url == f"http://{reached}:8103/sse"
