"""Admission's per-node fit: every worker is one bundle that must fit on one node."""

from __future__ import annotations

import pytest

from service.admission import never_fits
from workers.spec import JobSpec


@pytest.mark.parametrize("spec, nodes, fits", [
    (dict(workers=4, resources={"cpu": 2}), [{"CPU": 3}, {"CPU": 3}, {"CPU": 4}], True),   # 1 + 1 + 2
    (dict(workers=4, resources={"cpu": 2}), [{"CPU": 3}, {"CPU": 3}, {"CPU": 3}], False),  # 9 CPUs, 3 workers
    (dict(workers=2, resources={"gpu": 1}), [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}], True),
    (dict(workers=2, resources={"gpu": 2}), [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}], False),
    (dict(workers=2, resources={"custom": {"trainer": 1}}), [{"CPU": 4, "trainer": 1}, {"CPU": 4}], False),
    (dict(workers=2, resources={"custom": {"trainer": 1}}), [{"CPU": 4, "trainer": 2}, {"CPU": 4}], True),
    (dict(workers={"min": 2, "max": 8}), [{"CPU": 2}], True),  # an elastic job starts at its minimum
    (dict(workers=1), [], False),
    (dict(workers=3, resources={"cpu": 1e-300}), [{"CPU": 8}], True),  # divides to infinity: capped, no overflow
])
def test_per_node_fit(spec, nodes, fits):
    why = never_fits(JobSpec(**spec), {"node_resources": nodes})
    assert (why is None) == fits, why


def test_the_reason_names_the_need_and_what_each_node_offers():
    why = never_fits(JobSpec(workers=2, resources={"cpu": 1, "custom": {"trainer": 1}}),
                     {"node_resources": [{"CPU": 4, "trainer": 1}, {"CPU": 4}]})
    assert why == ("2 workers need 2 CPUs, 2 trainer in all, 1 CPUs, 1 trainer per worker on one node; the cluster's "
                   "nodes (4 CPUs, 1 trainer; 4 CPUs, 0 trainer) hold 1 of them, so this job could never start")
