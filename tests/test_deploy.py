"""deploy/: the Kubernetes base validates against the Kubernetes OpenAPI schemas
(``kubernetes-validate``, strict, offline) and its pieces refer to each other correctly; the
compose file and the Dockerfile describe a non-root, control-plane-only broker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prerequisites import require_binary

DEPLOY = Path(__file__).parent.parent / "deploy"
BASE = DEPLOY / "k8s" / "base"
#: Oldest Kubernetes the base supports (gRPC probes are GA since 1.27).
KUBERNETES_VERSION = "1.27"
ENGINE_PACKAGES = ("torch", "nixl", "vllm")


def resources() -> list[dict]:
    """Every document of every file the kustomization lists."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [
        doc
        for name in kustomization["resources"]
        for doc in yaml.safe_load_all((BASE / name).read_text())
        if doc
    ]


def find(kind: str, name: str) -> dict:
    matches = [r for r in resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, (kind, name)
    return matches[0]


def test_every_manifest_validates_strictly() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    kinds = []
    for resource in resources():
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        kinds.append(resource["kind"])
    assert sorted(kinds) == sorted(
        [
            "ConfigMap",
            "Secret",
            "Deployment",
            "Service",
            "Service",
            "PodDisruptionBudget",
            "Service",
            "StatefulSet",
        ]
    )


def test_validation_rejects_a_broken_manifest() -> None:
    """The validator really checks: a misspelt probe field and a port of the wrong type fail."""
    deployment = find("Deployment", "pdbroker")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grcp"] = container["readinessProbe"].pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    container["readinessProbe"]["grpc"] = {"port": "grpc"}
    del container["readinessProbe"]["grcp"]
    with pytest.raises(kubernetes_validate.ValidationError, match="not of type 'integer'"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_pieces_refer_to_each_other() -> None:
    deployment = find("Deployment", "pdbroker")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for service in ("pdbroker", "pdbroker-headless"):
        assert find("Service", service)["spec"]["selector"].items() <= labels.items()
    assert (
        find("PodDisruptionBudget", "pdbroker")["spec"]["selector"]["matchLabels"].items()
        <= labels.items()
    )
    assert (
        deployment["spec"]["replicas"]
        > find("PodDisruptionBudget", "pdbroker")["spec"]["minAvailable"]
    )

    container = pod["spec"]["containers"][0]
    config = find("ConfigMap", container["envFrom"][0]["configMapRef"]["name"])["data"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config["PDBROKER_LISTEN"] == f"0.0.0.0:{ports['grpc']}"
    assert config["PDBROKER_HEALTH_PORT"] == str(ports["health"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"]  # TLS on grpc: no probes
    assert container["readinessProbe"]["grpc"]["service"] == "pdbroker.v1.Broker"
    (volume,) = pod["spec"]["volumes"]
    secret = find("Secret", volume["secret"]["secretName"])
    assert secret["type"] == "kubernetes.io/tls"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    for variable, key in (("PDBROKER_TLS_CERT", "tls.crt"), ("PDBROKER_TLS_KEY", "tls.key"),
                          ("PDBROKER_TLS_CLIENT_CA", "ca.crt")):  # fmt: skip
        assert config[variable] == f"{mount['mountPath']}/{key}" and key in secret["data"]
    assert "PDBROKER_INSECURE" not in config

    store = urlsplit(config["PDBROKER_STORE"])
    redis_service = find("Service", store.hostname)
    assert redis_service["spec"]["ports"][0]["port"] == store.port
    redis = find("StatefulSet", redis_service["metadata"]["name"])
    assert (
        redis_service["spec"]["selector"].items()
        <= redis["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "noeviction" in redis["spec"]["template"]["spec"]["containers"][0]["args"]

    for workload in (deployment, redis):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_kustomize_builds_the_base() -> None:
    kubectl = require_binary("kubectl", "the kustomize build of the base is not checked")
    built = subprocess.run(
        [kubectl, "kustomize", str(BASE)], check=True, capture_output=True, text=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    assert len(docs) == len(resources())
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdbroker"
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    images = [
        c["image"]
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert images == ["pdbroker:0.1.0"]


def test_compose_runs_two_replicas_on_redis_with_a_collector() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "broker-a", "broker-b", "otel-collector"}
    published = set()
    for name in ("broker-a", "broker-b"):
        broker = services[name]
        env = broker["environment"]
        assert urlsplit(env["PDBROKER_STORE"]).hostname == "redis"
        assert urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"]).hostname == "otel-collector"
        assert broker["build"]["dockerfile"] == "deploy/Dockerfile"
        assert broker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert broker["command"] == ["serve", "--insecure"]  # development: plaintext, said so
        published.add(broker["ports"][0].split(":")[0])
    assert len(published) == 2  # each replica reachable on its own host port
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def test_dockerfile_is_multi_stage_non_root_and_control_plane_only() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE)
    assert len(stages) >= 2 and stages[0][1] == "build"
    final = text[text.rindex("\nFROM ") :]
    assert "COPY --from=build" in final
    user = re.findall(r"^USER\s+(\d+)", final, re.MULTILINE)
    assert user and int(user[-1]) != 0
    installs = re.findall(r"pip install[^\n&]*", text)
    assert installs and all("[" not in i for i in installs)  # no extras: base dependencies only
    assert not any(pkg in i for i in installs for pkg in ENGINE_PACKAGES)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :][:1] == ["!pyproject.toml"]  # deny all, then allow
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    base = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert not any(pkg in base for pkg in ENGINE_PACKAGES)


def test_image_holds_the_broker_alone() -> None:
    """The image copies ``broker/`` and nothing of the client library or the harness, and
    what its build step imports, and ``pdbroker``'s command line, work without them."""
    text = (DEPLOY / "Dockerfile").read_text()
    copied = re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, re.MULTILINE)
    assert copied == ["pyproject.toml README.md", "broker"]
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert [e for e in ignore if e.startswith("!")] == ["!pyproject.toml", "!README.md", "!broker/"]
    hidden = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('clients', 'harness'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import broker.server, broker.store.redis, broker.cli\n"
        "broker.cli.build_parser()\n"
    )
    subprocess.run(
        [sys.executable, "-c", hidden], check=True, cwd=DEPLOY.parent, capture_output=True
    )
