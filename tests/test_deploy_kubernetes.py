"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (offline: the
kubernetes-validate package bundles them), the generated ones are what config/butlers makes,
and what no schema can say holds: a Deployment and a Service per butler on its port, two
switchboard replicas with session affinity and a disruption budget, readiness on /health and
liveness on /livez (a database blip restarts no pod), no real secret, no database in the
cluster."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.33"  # a version its schemas are bundled for; clusters run 1.31-1.35 today


def documents() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(DEPLOY.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    }


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return {
        doc["metadata"]["name"]: doc
        for docs in documents().values()
        for doc in docs
        if doc["kind"] == kind
    }


def shipped() -> dict[str, dict[str, Any]]:
    return {
        path.parent.name: tomllib.loads(path.read_text())
        for path in (ROOT / "config" / "butlers").glob("*/butler.toml")
    }


@pytest.mark.parametrize("name", sorted(documents()))
def test_every_manifest_is_valid_for_kubernetes(name: str) -> None:
    for doc in documents()[name]:
        # strict: a key the schema does not know (a typo) is an error too
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_a_wrong_manifest_is_refused() -> None:
    """The validation can fail: a typo in a container, a port as a string."""
    deployment = objects("Deployment")["general"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for broken in (
        {**container, "imagePullPolicyy": "Always"},
        {**container, "ports": [{"containerPort": "8101"}]},
    ):
        spec = {**deployment["spec"]["template"]["spec"], "containers": [broken]}
        bad = {
            **deployment,
            "spec": {
                **deployment["spec"],
                "template": {**deployment["spec"]["template"], "spec": spec},
            },
        }
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def test_the_generated_manifests_are_what_config_butlers_makes() -> None:
    check = subprocess.run(
        [sys.executable, str(DEPLOY / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr


def test_kustomization_lists_the_manifests_and_not_the_example_secret() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        name for name in documents() if name != "secret.example.yaml"
    )


def test_a_deployment_and_a_service_per_butler_on_its_port() -> None:
    deployments, services = objects("Deployment"), objects("Service")
    butlers = shipped()
    assert set(deployments) == set(services) == set(butlers)
    config = objects("ConfigMap")["butlers-config"]["data"]
    for name, toml in butlers.items():
        port = toml["butler"]["port"]
        assert [p["port"] for p in services[name]["spec"]["ports"]] == [port]
        assert services[name]["spec"]["selector"] == {"app.kubernetes.io/name": name}
        pod = deployments[name]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert container["args"] == ["run", name]
        assert [p["containerPort"] for p in container["ports"]] == [port]
        # Readiness follows the database; liveness and start-up only the process.
        ready = container["readinessProbe"]["httpGet"]
        assert (ready["path"], ready["port"]) == ("/health", port)
        assert {"name": "Host", "value": "localhost"} in ready["httpHeaders"]
        for probe in ("livenessProbe", "startupProbe"):
            check = container[probe]["httpGet"]
            assert (check["path"], check["port"]) == ("/livez", port), probe
        startup = container["startupProbe"]
        # Room for creating and migrating the database before the first answer.
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert {"secretRef": {"name": "butlers-secrets"}} in container["envFrom"]
        # Every butler.toml, where `butlers run` and discover() look for it.
        [volume] = [v for v in pod["volumes"] if "configMap" in v]
        assert {i["path"] for i in volume["configMap"]["items"]} == {
            f"{n}/butler.toml" for n in butlers
        }
        assert tomllib.loads(config[f"{name}.butler.toml"]) == toml
        # The data directory is one butlers makes below the emptyDir, not the emptyDir itself
        # (root's and writable by the pod's group: `butlers run` refuses that).
        env = {e["name"]: e.get("value") for e in container["env"]}
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "data"]
        data_dir = Path(env["BUTLERS_DATA_DIR"])
        assert data_dir.parent == Path(mount["mountPath"]) and env["HOME"] == mount["mountPath"]


def test_two_switchboard_replicas_behind_a_service_with_affinity() -> None:
    [switchboard] = [name for name, toml in shipped().items() if "switchboard" in toml]
    assert objects("Deployment")[switchboard]["spec"]["replicas"] == 2
    assert objects("Service")[switchboard]["spec"]["sessionAffinity"] == "ClientIP"
    for name, deployment in objects("Deployment").items():
        if name != switchboard:
            assert deployment["spec"]["replicas"] == 1


def test_a_switchboard_replica_stays_up_through_a_drain() -> None:
    [switchboard] = [name for name, toml in shipped().items() if "switchboard" in toml]
    assert set(objects("PodDisruptionBudget")) == {switchboard}
    budget = objects("PodDisruptionBudget")[switchboard]["spec"]
    assert budget["minAvailable"] == 1
    # It selects the switchboard's pods, as its Deployment labels them.
    labels = objects("Deployment")[switchboard]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()


def test_no_real_secret_and_no_database_in_the_cluster() -> None:
    [secret] = objects("Secret").values()
    assert secret["stringData"] and all(
        "CHANGE-ME" in value for value in secret["stringData"].values()
    )
    assert "DATABASE_URL" in secret["stringData"]
    images = [
        c["image"]
        for d in objects("Deployment").values()
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert not [i for i in images if "postgres" in i]
    assert not objects("StatefulSet")
