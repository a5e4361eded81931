"""deploy/grafana/dgrpo.json: every series a panel queries is one the services export (names taken from the
services' own metric definitions), so a renamed series cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dgrpo.json"


def exported_names() -> set[str]:
    """Every sample name our registries can produce (counters' _total, histograms' _bucket / _sum / _count ...)."""
    import dgrpo.rewarder.metrics  # noqa: F401 (its series register in the global registry on import)
    from dgrpo.learner.records.prometheus import LearnerMetrics
    from dgrpo.sampler.metrics import SamplerMetrics

    learner, sampler = LearnerMetrics(), SamplerMetrics("r0")
    names = set()
    for registry in (learner.registry, sampler.registry, REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(f"{family.name}{suffix}" for suffix in ("_total", "_bucket", "_sum", "_count", "_created"))
    return names


def test_every_panel_queries_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bdgrpo_[a-z_]+", e)}
    assert len(used) >= 15  # learner, sampler and rewarder all have panels
    assert {n.split("_")[1] for n in used} == {"learner", "sampler", "rewarder"}
    assert used <= exported_names(), sorted(used - exported_names())
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
