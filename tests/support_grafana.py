"""What Grafana does to a dashboard's queries: its label_values() variables, multi-value escaping, $variable substitution."""

from __future__ import annotations

import re

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LABEL_VALUES = re.compile(r"label_values\((.+),\s*(\w+)\)")


def regex_escape(value: str) -> str:
    # What Grafana's Prometheus data source does to each value of a multi-value variable.
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def substitute(expr: str, values: dict[str, str]) -> str:
    return _VARIABLE.sub(lambda m: values.get(m.group(1) or m.group(2), m.group(0)), expr)
