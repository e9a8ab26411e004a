"""Placement of a fleet's models onto GPU meshes: MuxServe's greedy and ours hold every model, within memory and the
cluster's nodes, and ours reads each model's own predicted lengths."""

from __future__ import annotations

import dataclasses

import pytest

from serving.bench.models.fidelity import Engine
from serving.placement.models.estimate import Demand, Estimator
from serving.placement.models.lengthwise import MEMORY_UTILISATION, fits_nodes, place_lengthwise
from serving.placement.models.muxserve import mesh_groups, node_splits, place_muxserve

ENGINE = Engine(mbu=0.35, tp_overhead_s=0.01)
FLEET = [Demand("a", "llama-7b", 2.0, 100, 260), Demand("b", "llama-13b", 1.0, 100, 260),
         Demand("c", "llama-30b", 1.5, 100, 260), Demand("d", "llama-65b", 0.8, 100, 260),
         Demand("e", "llama-13b", 12.0, 100, 260)]


def test_a_node_of_eight_splits_into_muxserves_ten_mesh_groups_and_a_cluster_into_whole_nodes():
    assert sorted(node_splits(8)) == sorted([(8,), (4, 4), (4, 2, 2), (4, 2, 1, 1), (4, 1, 1, 1, 1), (2, 2, 2, 2),
                                             (2, 2, 2, 1, 1), (2, 2, 1, 1, 1, 1), (2, 1, 1, 1, 1, 1, 1), (1,) * 8])
    groups = list(mesh_groups(20))
    assert groups and all(sum(g) == 20 and fits_nodes(g, 20) for g in groups)
    # nodes taken as a multiset (MuxServe's combinations with replacement): 10 splits of each full node, 4 of the rest
    assert len(groups) == 55 * 4 and [8, 8, 4] in groups and [8, 4, 4, 4] in groups
    assert fits_nodes([4, 4, 4], 12) and not fits_nodes([8, 8], 12) and not fits_nodes([4, 4, 4], 11)


def _check(plan, demands: list[Demand], gpus: int) -> None:
    assert plan is not None and plan.gpus <= gpus and fits_nodes([u.gpus for u in plan.units], gpus)
    shares: dict[str, float] = {}
    for u in plan.units:
        names = [m.name for m in u.models]
        assert len(names) == len(set(names))  # a model's replicas are on different meshes
        weights = sum(d.weights_gb for d in demands if d.name in names)
        assert weights + u.kv_fraction * u.gpus * 80 <= u.gpus * 80 + 1e-6
        for m in u.models:
            assert m.tp == u.gpus and 0 < m.decode_sm <= 1 and 0 < m.prefill_sm <= 1
            shares[m.name] = shares.get(m.name, 0.0) + m.rate_share
    assert shares == pytest.approx({d.name: 1.0 for d in demands})


@pytest.mark.parametrize("place", [place_muxserve, place_lengthwise], ids=["muxserve", "lengthwise"])
def test_each_placement_holds_every_model_within_memory_and_the_nodes(place):
    est = Estimator(ENGINE.latency)
    plan = place(FLEET, 16, est)
    _check(plan, FLEET, 16)
    assert plan.decision_s > 0
    assert place(FLEET, 2, est) is None  # the 65B's weights alone need more


def test_ours_shares_meshes_when_gpus_are_few_and_gives_a_busy_model_replicas():
    est = Estimator(ENGINE.latency)
    few, many = place_lengthwise(FLEET, 9, est), place_lengthwise(FLEET, 24, est)
    _check(few, FLEET, 9)
    _check(many, FLEET, 24)
    assert any(len(u.models) > 1 for u in few.units)
    # more GPUs go to faster meshes: the worst model is slowed less
    assert few.notes["slowdown"] > many.notes["slowdown"] and many.gpus > few.gpus
    busy = [Demand("hot", "llama-13b", 40.0, 100, 260)]
    plan = place_lengthwise(busy, 16, est)
    _check(plan, busy, 16)
    assert len(plan.units) > 1 and all(m.rate_share < 1 for u in plan.units for m in u.models)


def test_ours_reads_each_models_own_lengths_and_muxserve_one_pair_for_all():
    est = Estimator(ENGINE.latency)
    short = [Demand("x", "llama-13b", 1.0, 60, 80), Demand("y", "llama-13b", 1.0, 60, 80)]
    long_y = [short[0], dataclasses.replace(short[1], output_len=600)]
    # two short-answer 13Bs share one GPU; when one answers at length, its KV does not fit beside the other
    both = place_lengthwise(short, 1, est)
    _check(both, short, 1)
    assert len(both.units) == 1 and place_lengthwise(long_y, 1, est) is None
    # on one mesh the longer answers get the larger KV quota
    shared = place_lengthwise(long_y, 4, est)
    _check(shared, long_y, 4)
    quota = {m.name: m.kv_share for u in shared.units for m in u.models}
    assert len(shared.units) == 1 and quota["y"] > 4 * quota["x"]
    assert all(u.kv_fraction <= MEMORY_UTILISATION for u in shared.units)
    # MuxServe's estimator sees the lengths it is given: longer answers need a larger batch for the same rate
    assert est.throughput(long_y[1], 1, 0.9, 40.0)[2] > est.throughput(short[1], 1, 0.9, 40.0)[2]


@pytest.mark.unit
def test_a_plan_still_fits_the_demand_it_was_made_for_and_not_a_busier_one():
    """Ours keeps a plan while it carries a later window's demand within the slowdown it was made at (re-placement
    as rates drift): the same rates fit, a busiest model three times as busy does not."""
    from serving.placement.models.lengthwise import still_fits
    from serving.placement.models.replace import grouping, regroups

    est = Estimator(ENGINE.latency)
    plan = place_lengthwise(FLEET, 16, est)
    assert plan is not None and still_fits(plan, FLEET, est)
    busiest = max(FLEET, key=lambda d: d.rate)
    busier = [dataclasses.replace(d, rate=3 * d.rate) if d is busiest else d for d in FLEET]
    assert not still_fits(plan, busier, est)
    again = place_lengthwise(busier, 24, est)
    assert again is not None and regroups(plan, again) == (grouping(again) != grouping(plan))
    assert not regroups(plan, None) and not regroups(plan, plan)
