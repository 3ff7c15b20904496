"""GET /metrics read back with prometheus_client's own exposition-format parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} from the exposition text (the parser rejects malformed text)."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample `name` with exactly `labels` from what `scrape` returned."""
    return samples[name][tuple(sorted(labels.items()))]
