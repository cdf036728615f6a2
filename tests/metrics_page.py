"""A ``/metrics`` page read as Prometheus reads it (``prometheus_client``'s own parser)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the page at ``url``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample's value; 0 when the page has no such series (a counter not yet counted)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
