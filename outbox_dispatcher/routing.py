"""Which topic a row goes to: its own `topic`, else the topic template filled from its headers,
else the default topic. A row none of them routes is dead-lettered with the reason."""

from __future__ import annotations

import re
from collections.abc import Mapping

from outbox_dispatcher import errors

TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9._-]+)\}")


def valid_topic(name: str) -> bool:
    """Kafka's topic-name rules, and not an internal topic (`__consumer_offsets`, ...)."""
    return bool(TOPIC.match(name)) and name not in (".", "..") and not name.startswith("__")


def check_template(template: str) -> str:
    """Validate OUTBOX_TOPIC_TEMPLATE: topic characters around {header-name} placeholders."""
    depth = 0
    for char in template:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth not in (0, 1):
            break
    if depth != 0:
        msg = f"OUTBOX_TOPIC_TEMPLATE {template!r} has an unbalanced '{{' or '}}'"
        raise ValueError(msg)
    if not _PLACEHOLDER.search(template):
        msg = "OUTBOX_TOPIC_TEMPLATE needs at least one {header-name} placeholder"
        raise ValueError(msg)
    literal = _PLACEHOLDER.sub("x", template)
    if "{" in literal or "}" in literal or not valid_topic(literal):
        msg = (
            f"OUTBOX_TOPIC_TEMPLATE {template!r} is not a topic name with {{header-name}} "
            "placeholders (letters, digits, '.', '_', '-')"
        )
        raise ValueError(msg)
    return template


class Router:
    def __init__(self, default_topic: str | None, template: str | None) -> None:
        self._default = default_topic
        self._template = template
        self._names = _PLACEHOLDER.findall(template) if template else []

    @property
    def header_names(self) -> list[str]:
        """The headers the topic template names (none without a template)."""
        return list(self._names)

    def topic_for(self, topic: str | None, headers: Mapping[str, str]) -> str:
        if topic is not None:
            return topic
        missing: list[str] = []
        if self._template is not None:
            missing = [name for name in self._names if name not in headers]
            if not missing:
                routed = _PLACEHOLDER.sub(lambda m: headers[m.group(1)], self._template)
                if not valid_topic(routed):
                    msg = (
                        f"OUTBOX_TOPIC_TEMPLATE {self._template!r} made {routed!r} from the row's "
                        "headers, which is not a valid topic name"
                    )
                    raise errors.RoutingError(msg)
                return routed
        if self._default is not None:
            return self._default
        if self._template is not None:
            msg = (
                f"the row has no topic, lacks header(s) {', '.join(missing)} for "
                "OUTBOX_TOPIC_TEMPLATE, and OUTBOX_DEFAULT_TOPIC is not set"
            )
        else:
            msg = (
                "the row has no topic and neither OUTBOX_TOPIC_TEMPLATE nor OUTBOX_DEFAULT_TOPIC "
                "is set"
            )
        raise errors.RoutingError(msg)
