"""LLM.get_metrics' values, as vLLM's vllm.v1.metrics.reader gives them: a Prometheus registry's
minillm: series as plain Counter, Gauge, Histogram and Vector objects."""
from __future__ import annotations

from dataclasses import dataclass

from minillm.spec_decode.metrics import PER_POSITION_COUNTER

PREFIX = "minillm:"


@dataclass
class Metric:
    """One series: its name (minillm:..., as vLLM's vllm:...) and labels (model_name, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Vector(Metric):
    """Counters by position (vLLM's shape of spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations: buckets maps each upper bound ("0.1", ..., "+Inf") to the values at or under
    it (cumulative, as Prometheus counts), so buckets["+Inf"] == count; sum adds them up."""

    count: int
    sum: float
    buckets: dict[str, int]


def metrics_snapshot(registry) -> list[Metric]:
    """The registry's minillm: series now, one Metric per label set (vLLM's get_metrics_snapshot). A
    summary (minillm's structured-output timings) is a Histogram of its one "+Inf" bucket."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, dict(s.labels), s.value) for s in _samples(family)]
        elif family.type == "counter" and family.name == PER_POSITION_COUNTER[0]:
            collected += _vectors(family.name, _samples(family, "_total"), PER_POSITION_COUNTER[2])
        elif family.type == "counter":
            collected += [Counter(family.name, dict(s.labels), int(s.value)) for s in _samples(family, "_total")]
        elif family.type in ("histogram", "summary"):
            collected += _histograms(family)
        else:
            raise ValueError(f"metric {family.name} is of type {family.type!r}, which get_metrics does not read")
    return collected


def _samples(family, suffix: str = "") -> list:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict, leave_out: str | None = None) -> tuple:
    """A label set as a key, without one label (le, position)."""
    return tuple(sorted((k, v) for k, v in labels.items() if k != leave_out))


def _histograms(family) -> list[Histogram]:
    """A histogram (or summary) family's series, one per label set besides le."""
    buckets: dict[tuple, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    sums = {_key(s.labels): s.value for s in _samples(family, "_sum")}
    out = []
    for s in _samples(family, "_count"):
        key = _key(s.labels)
        out.append(Histogram(family.name, dict(key), int(s.value), sums.get(key, 0.0),
                             buckets.get(key, {"+Inf": int(s.value)})))
    return out


def _vectors(name: str, samples: list, position_label: str) -> list[Vector]:
    """Counters labelled by position as one Vector per other label set, index i holding position i."""
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_key(s.labels, position_label), {})[int(s.labels[position_label])] = int(s.value)
    size = 1 + max((p for values in by_labels.values() for p in values), default=-1)
    return [Vector(name, dict(key), [values.get(p, 0) for p in range(size)]) for key, values in by_labels.items()]
