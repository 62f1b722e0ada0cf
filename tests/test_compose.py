"""docker-compose.yml: valid Compose, and in step with config/butlers; the Dockerfile's init
and health check (no Docker needed here: the health check's command runs against a real
butler)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from aiohttp import web

from butlers.config import Placement, load_config_dir
from tests.conftest import StartButler, free_port
from tests.fakes import serve_on_loopback

REPO = Path(__file__).resolve().parent.parent
SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.schema.json"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_file_is_valid_against_the_compose_schema(compose: dict) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []


def test_the_schema_check_can_fail(compose: dict) -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    broken = {**compose, "services": {**compose["services"], "general": {"restart": 3}}}
    assert list(validator.iter_errors(broken))


def test_every_butler_has_a_service_running_it_on_its_port(compose: dict) -> None:
    services = compose["services"]
    environment = services["general"]["environment"]
    placement = Placement.from_environment(environment)  # what the containers will see
    butlers = load_config_dir(REPO / "config" / "butlers", placement).butlers
    assert butlers
    for butler in butlers:
        service = services.get(butler.name)
        assert service is not None, f"no service for butler {butler.name!r}"
        assert service["command"] == ["run", butler.name]
        assert f"127.0.0.1:{butler.port}:{butler.port}" in service["ports"]
        assert str(butler.port) in " ".join(service["healthcheck"]["test"])
        # Reachable from the other containers under the service's name.
        assert butler.endpoint_url == f"http://{butler.name}:{butler.port}/sse"
        assert butler.host == "0.0.0.0"
        env = service["environment"]
        assert (
            env["DATABASE_URL"].startswith("postgresql://") and "@postgres:" in env["DATABASE_URL"]
        )
        # OTLP over HTTP (the gRPC exporter is an extra the image does not install).
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
        # An init reaps the orphans of Claude Code sessions.
        assert service["init"] is True
        assert {"postgres", "jaeger"} <= set(service["depends_on"])


def test_infrastructure_services(compose: dict) -> None:
    services = compose["services"]
    jaeger = services["jaeger"]
    image, _, tag = jaeger["image"].partition(":")
    assert image == "jaegertracing/jaeger" and tag.startswith("2.") and tag != "latest"
    assert {p.split(":", 1)[1] for p in jaeger["ports"]} >= {
        "16686:16686",
        "4317:4317",
        "4318:4318",
    }
    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:") and "healthcheck" in postgres
    assert any(v.startswith("pgdata:") for v in postgres["volumes"])
    # Every published port is bound to loopback only.
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_secrets_come_from_an_ignored_env_file(compose: dict) -> None:
    assert ".env" in (REPO / ".gitignore").read_text().split()
    example = (REPO / ".env.example").read_text()
    declared = {line.split("=", 1)[0] for line in example.splitlines() if "=" in line}
    needed = {"ANTHROPIC_API_KEY", "POSTGRES_PASSWORD", "BUTLERS_AUTH_TOKEN"}
    for butler in load_config_dir(REPO / "config" / "butlers", Placement()).butlers:
        if butler.telegram:
            needed.add(butler.telegram.token_env)
        if butler.email:
            needed |= {butler.email.username_env, butler.email.password_env}
    assert needed <= declared, needed - declared
    for name, service in compose["services"].items():
        if name in ("postgres", "jaeger"):
            continue
        assert service["env_file"] == ".env"
        written_in = needed & set(service["environment"])
        assert written_in == set(), f"{name}: {written_in} belong in .env, not the compose file"


def test_the_replicas_profile_adds_a_switchboard_behind_the_same_name(compose: dict) -> None:
    """`--profile replicas`: a second `butlers run switchboard` on the same database, reached
    by the name `switchboard` (a network alias), publishing no second port."""
    services = compose["services"]
    replica = services["switchboard-replica"]
    assert replica["profiles"] == ["replicas"]
    assert replica["command"] == services["switchboard"]["command"] == ["run", "switchboard"]
    assert replica["environment"] == services["switchboard"]["environment"]
    assert replica["networks"]["default"]["aliases"] == ["switchboard"]
    assert "ports" not in replica
    assert all("profiles" not in s for name, s in services.items() if name != "switchboard-replica")


def test_a_switchboard_stops_first_and_has_time_to_finish_its_messages(compose: dict) -> None:
    """Compose stops a service before those it depends on: every switchboard depends on every
    butler, so a route it makes while its messages finish (stop_drain_s, 10 s) still finds
    them; and it gets more than that before SIGKILL (compose's default is 10 s)."""
    services = compose["services"]
    butlers = {
        name
        for name, service in services.items()
        if service.get("command", [None])[0] == "run" and "switchboard" not in name
    }
    assert butlers == {"general", "health", "relationship"}
    for name in ("switchboard", "switchboard-replica"):
        assert butlers | {"postgres", "jaeger"} <= set(services[name]["depends_on"]), name
        assert services[name]["stop_grace_period"] == "30s"


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, (KEYWORD, rest), continuation lines joined."""
    text = (REPO / "Dockerfile").read_text()
    logical = text.replace("\\\n", " ")
    found = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def healthcheck_command() -> list[str]:
    """The HEALTHCHECK's exec form: JSON, as Docker reads it."""
    [rest] = [rest for keyword, rest in dockerfile() if keyword == "HEALTHCHECK"]
    return json.loads(rest.partition("CMD ")[2])


def test_the_image_runs_under_tini_and_checks_its_liveness() -> None:
    instructions = dockerfile()
    entrypoint = [json.loads(rest) for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == [["tini", "-s", "--", "butlers"]]
    assert any(
        keyword == "RUN" and "apt-get install" in rest and " tini" in rest
        for keyword, rest in instructions
    )
    command = healthcheck_command()
    assert command[:2] == ["python", "-c"] and "/livez" in command[2]
    [exposed] = [rest.split() for keyword, rest in instructions if keyword == "EXPOSE"]
    assert command[3:] == exposed  # every port a butler of the image may serve


async def _health(*ports: int) -> int:
    """The image's health check, as Docker runs it, against these ports on loopback."""
    command = healthcheck_command()
    process = await asyncio.create_subprocess_exec(
        sys.executable, *command[1:3], *map(str, ports), stdout=asyncio.subprocess.DEVNULL
    )
    async with asyncio.timeout(60):
        return await process.wait()


async def test_the_images_health_check_asks_a_real_butlers_livez(
    start_butler: StartButler,
) -> None:
    """Healthy: a butler answering /livez, the other ports refused (not served here);
    unhealthy: nothing listening, a port answering 404 (not a butler), or one that hangs."""
    butler = await start_butler()
    assert await _health(butler.port, free_port()) == 0
    assert await _health(free_port(), free_port()) == 1

    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/livez", hang)
    hung_runner, hung_url = await serve_on_loopback(app)
    empty_runner, empty_url = await serve_on_loopback(web.Application())
    try:
        assert await _health(butler.port, int(empty_url.rsplit(":", 1)[1])) == 1
        assert await _health(butler.port, int(hung_url.rsplit(":", 1)[1])) == 1
    finally:
        release.set()
        await hung_runner.cleanup()
        await empty_runner.cleanup()
