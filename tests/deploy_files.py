"""Reading deploy/: the Dockerfile's stages and the names the dispatcher reads and exports.

Shared by tests/unit/test_deploy.py (static checks) and tests/integration/test_deploy.py (the
image's command run as PID 1).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

from outbox_dispatcher import metrics
from outbox_dispatcher.batch_histogram import BatchHistogram
from outbox_dispatcher.config.names import env_name as _env_name
from outbox_dispatcher.config.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"

# Labels Prometheus or Kubernetes service discovery put on every scraped series.
TARGET_LABELS = frozenset(
    {"job", "instance", "pod", "namespace", "container", "service", "endpoint"}
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def _logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comment lines dropped (as Docker
    does, also inside a continued instruction)."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            stages[-1].instructions.append((keyword, rest))
    return stages


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) instruction argument; shell form is an error here."""
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return [str(v) for v in value]


def healthcheck_command(stage: Stage) -> list[str]:
    args = stage.last("HEALTHCHECK")
    assert args is not None
    _, _, command = args.partition("CMD ")
    return exec_form(command.strip())


def run_words(stage: Stage) -> list[str]:
    words: list[str] = []
    for command in stage.all("RUN"):
        words.extend(shlex.split(command))
    return words


# --- what the dispatcher reads -------------------------------------------------------------------

SETTINGS_ENV = frozenset(_env_name(name) for name in Settings.model_fields)


def valid_env_name(name: str) -> bool:
    """A variable the dispatcher reads: a setting, a setting's secret file, or the secrets dir."""
    if name in SETTINGS_ENV or name == "OUTBOX_SECRETS_DIR":
        return True
    return name.endswith("_FILE") and name.removesuffix("_FILE") in SETTINGS_ENV


# --- what the dispatcher exports -----------------------------------------------------------------


def exported_metrics() -> dict[str, frozenset[str]]:
    """Every series name the dispatcher exports under outbox_, with its label names: those of
    the single-table process and of a process of many outboxes (OUTBOX_SOURCES: the per-outbox
    families add `source`), united, since one dashboard and one rule file serve both.

    Derived from metrics.NAMES with the suffixes the client adds (counters are listed with
    _total; histograms add _bucket/_sum/_count), labels from live Metrics() registries.
    """
    single, many = _exported_by(metrics.Metrics()), _exported_by(metrics.Metrics(max_sources=2))
    return {name: single.get(name, frozenset()) | many.get(name, frozenset()) for name in many}


def per_source_metrics() -> frozenset[str]:
    """The series a process of many outboxes labels with `source`."""
    many = _exported_by(metrics.Metrics(max_sources=2))
    return frozenset(name for name, labels in many.items() if "source" in labels)


def _exported_by(registry: metrics.Metrics) -> dict[str, frozenset[str]]:
    wrappers = [value for value in vars(registry).values() if isinstance(value, MetricWrapperBase)]
    # _name and _labelnames are prometheus_client internals: labelled metrics without children
    # expose no samples to read the label names from.
    by_name: dict[str, MetricWrapperBase] = {}
    for wrapper in wrappers:
        name = wrapper._name
        if isinstance(wrapper, Counter):
            name += "_total"
        by_name[name] = wrapper
    # Histograms fed a batch at a time (BatchHistogram).
    batched = [value for value in vars(registry).values() if isinstance(value, BatchHistogram)]
    assert set(by_name) | {b.name for b in batched} == set(metrics.NAMES), (
        "metrics.NAMES is out of step with Metrics()"
    )
    exported: dict[str, frozenset[str]] = {}
    families: list[tuple[str, Any]] = [*by_name.items(), *((b.name, b) for b in batched)]
    for name, wrapper in families:
        labels = frozenset(wrapper._labelnames)
        if isinstance(wrapper, (Histogram, BatchHistogram)):
            exported[f"{name}_bucket"] = labels | {"le"}
            exported[f"{name}_sum"] = labels
            exported[f"{name}_count"] = labels
        else:
            exported[name] = labels
    return exported


METRIC = re.compile(r"\boutbox_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(outbox_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def promql_problems(expr: str, exported: dict[str, frozenset[str]]) -> list[str]:
    """Names and labels in one PromQL expression that the dispatcher does not export."""
    problems: list[str] = []
    used = set(METRIC.findall(expr))
    problems += [f"{name}: not exported" for name in sorted(used - set(exported))]
    labels_here = set(TARGET_LABELS)
    for name in used & set(exported):
        labels_here |= exported[name]
    for name, matchers in SELECTOR.findall(expr):
        for label in MATCHER.findall(matchers):
            if name in exported and label not in exported[name] | TARGET_LABELS:
                problems.append(f"{name}: no label {label!r}")
    for group in GROUPING.findall(expr):
        for label in (part.strip() for part in group.split(",")):
            if label and label not in labels_here:
                problems.append(f"label {label!r} in by/without is on none of {sorted(used)}")
    return problems


def grouping_labels(expr: str) -> set[str]:
    return {p.strip() for g in GROUPING.findall(expr) for p in g.split(",") if p.strip()}
