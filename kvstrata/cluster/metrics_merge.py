"""One /metrics page for the cluster: every replica's series with a `replica` label, plus their total."""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# Gauges that are fractions: their cluster value is the replicas' mean, not their sum.
MEAN_SUFFIXES = ("_perc", "_rate")
# Gauges whose labels carry the information and whose value is when it was read: the cluster's is the latest.
INFO_SUFFIX = "_info"


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        yield from self.families


def merge_replica_metrics(pages: dict[int, str], own: CollectorRegistry | None = None) -> bytes:
    """`pages`: each replica's Prometheus text by replica index. Families keep their names and help;
    each sample appears once per replica (labelled) and once aggregated (unlabelled by replica)."""
    families: dict[str, Metric] = {}
    totals: dict[tuple[str, str, tuple], list[float]] = defaultdict(list)
    for replica, text in sorted(pages.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
                totals[(family.name, sample.name, tuple(sorted(sample.labels.items())))].append(sample.value)
    for (family_name, sample_name, labels), values in totals.items():
        family = families[family_name]
        gauge = family.type == "gauge"
        total = (fmean(values) if gauge and family_name.endswith(MEAN_SUFFIXES)
                 else max(values) if gauge and family_name.endswith(INFO_SUFFIX) else sum(values))
        family.add_sample(sample_name, dict(labels), total)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    text = generate_latest(registry)
    return text + generate_latest(own) if own is not None else text
