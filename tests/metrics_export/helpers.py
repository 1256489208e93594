"""Reading a /metrics reply: prometheus_client's own parser of the text format."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by (sample name, its labels)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float:
    """The sample ``name{labels}``; ``default`` when it is absent (None: absent fails the test)."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        if default is not None:
            return default
        present = sorted(dict(k[1]) for k in samples if k[0] == name) if samples else []
        raise AssertionError(f"no sample {name}{labels}; present: {present}")
    return samples[key]
