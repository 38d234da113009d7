"""tapas.planning.cost: golden values computed by hand from the closed-form alpha-beta model."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tapas.planning import cost
from tapas.planning.cost import (Cluster, CostBreakdown, CostOptions, CostTerm, Link,
                                 collective_cost, collective_time, ring_factor)
from tapas.sharding.placements import Collective

# The V100 preset's constants, written out so that a change to the preset fails here.
NVLINK_ALPHA = 3.4e-6          # s per hop
NVLINK_BETA = 1 / 150e9        # s per byte
ETH_ALPHA = 9.6e-6
ETH_BETA = 8 / 100e9           # 100 Gb/s
GAMMA = 0.5
EPS = {"AR": 1.0, "AG": 0.8, "RS": 0.8, "A2A": 1.0}

B, S, H = 8, 512, 1024
FP32 = 4
ACT = B * S * H * FP32         # a [B*S, H] fp32 activation: 16 MiB


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


@pytest.fixture
def node() -> Cluster:
    return Cluster.v100_ethernet()


def test_v100_preset_constants(node: Cluster) -> None:
    assert (node.num_nodes, node.devices_per_node, node.num_devices) == (1, 8, 8)
    assert close(node.intra.latency, NVLINK_ALPHA) and close(node.intra.beta, NVLINK_BETA)
    assert close(node.inter.latency, ETH_ALPHA) and close(node.inter.beta, ETH_BETA)
    assert node.device_memory == 32 * 2**30
    assert node.device_peak_flops == 15.7e12
    for key in cost.SOURCE_KEYS:
        assert node.source(key) != "unspecified", key
    opts = CostOptions()
    assert opts.gamma == GAMMA and dict(opts.epsilon) == EPS


def test_loopback_preset_is_documented() -> None:
    c = Cluster.loopback_cpu(4)
    assert c.num_devices == 4 and c.num_nodes == 1
    assert "measured by benchmarks/measure_collectives.py on" in c.source("intra.bandwidth")
    assert c.axis(4).link == c.intra


# ---- Megatron MLP: column-parallel then row-parallel, 1 node of 8 V100 -------------------

def megatron_mlp(cluster: Cluster, options: CostOptions) -> CostBreakdown:
    fwd = collective_cost("AR", ACT, cluster.axis(8), options, backward=False, label="g")
    bwd = collective_cost("AR", ACT, cluster.axis(8), options, backward=True, label="f")
    return CostBreakdown() + fwd + bwd


def test_megatron_mlp_all_terms(node: Cluster) -> None:
    w = 8
    lat = NVLINK_ALPHA * w
    trans_fwd = NVLINK_BETA * 2 * (w - 1) / w * ACT * EPS["AR"]
    trans_bwd = NVLINK_BETA * 2 * (w - 1) / w * ACT * GAMMA * EPS["AR"]
    bd = megatron_mlp(node, CostOptions())
    fwd, bwd = bd.terms
    assert (fwd.kind, fwd.nbytes, fwd.group_size, fwd.nodes, fwd.backward) == \
        (Collective.ALL_REDUCE, ACT, 8, 1, False)
    assert bwd.backward and bwd.direction == "backward" and fwd.direction == "forward"
    assert close(fwd.latency, lat) and close(bwd.latency, lat)
    assert close(fwd.transmission, trans_fwd) and close(bwd.transmission, trans_bwd)
    assert close(bd.total, 2 * lat + trans_fwd + trans_bwd)
    assert close(bd.latency, 2 * lat) and close(bd.transmission, trans_fwd + trans_bwd)
    assert close(bd.by_direction()["forward"], lat + trans_fwd)
    assert close(bd.by_direction()["backward"], lat + trans_bwd)
    assert list(bd.by_kind()) == [Collective.ALL_REDUCE]
    assert close(bd.by_kind()[Collective.ALL_REDUCE], bd.total)
    # 16 MiB * 1.75 / 150 GB/s = 195.7 us forward; the numbers a reader can check
    assert round(trans_fwd * 1e6, 1) == 195.7 and round(lat * 1e6, 1) == 27.2
    assert "AR" in str(bd) and "total" in str(bd)


@pytest.mark.parametrize("switch", ["latency", "gradient_overlap", "collective_efficiency"])
def test_megatron_mlp_each_option_off(node: Cluster, switch: str) -> None:
    w = 8
    opts = dataclasses.replace(CostOptions(), **{switch: False})
    lat = 0.0 if switch == "latency" else NVLINK_ALPHA * w
    gamma = 1.0 if switch == "gradient_overlap" else GAMMA
    eps = 1.0 if switch == "collective_efficiency" else EPS["AR"]
    trans = NVLINK_BETA * 2 * (w - 1) / w * ACT * eps
    bd = megatron_mlp(node, opts)
    assert close(bd.terms[0].latency, lat) and close(bd.terms[1].latency, lat)
    assert close(bd.terms[0].transmission, trans)
    assert close(bd.terms[1].transmission, trans * gamma)
    assert close(bd.total, 2 * lat + trans * (1 + gamma))


def test_vanilla_options_are_plain_alpha_beta(node: Cluster) -> None:
    bd = megatron_mlp(node, CostOptions.vanilla())
    per = NVLINK_ALPHA * 8 + NVLINK_BETA * 1.75 * ACT
    assert close(bd.terms[0].total, per) and close(bd.terms[1].total, per)


# ---- data parallel: gradient all-reduce of the weight in the backward pass only ----------

def test_data_parallel_gradient_all_reduce(node: Cluster) -> None:
    weight = H * 4 * H * FP32 + 4 * H * FP32          # kernel [H, 4H] + bias [4H]
    term = collective_cost(Collective.ALL_REDUCE, weight, node.axis(8), backward=True)
    expected_trans = NVLINK_BETA * 1.75 * weight * GAMMA * EPS["AR"]
    assert close(term.transmission, expected_trans)
    assert close(term.latency, NVLINK_ALPHA * 8)
    bd = CostBreakdown([term])
    assert bd.by_direction()["forward"] == 0.0
    assert close(bd.by_direction()["backward"], NVLINK_ALPHA * 8 + expected_trans)
    no_overlap = collective_cost("AR", weight, node.axis(8), CostOptions(gradient_overlap=False),
                                 backward=True)
    assert close(no_overlap.transmission, expected_trans / GAMMA)


# ---- column-parallel layer: all-gather the output forward, reduce-scatter backward -------

def test_column_parallel_all_gather_reduce_scatter(node: Cluster) -> None:
    out = B * S * 4 * H * FP32                        # gathered output [B*S, 4H]
    ag = collective_cost("all_gather", out, node.axis(8))
    rs = collective_cost("RS", out, node.axis(8), backward=True)
    f = 7 / 8
    assert close(ag.transmission, NVLINK_BETA * f * out * EPS["AG"])
    assert close(rs.transmission, NVLINK_BETA * f * out * GAMMA * EPS["RS"])
    assert close(ag.latency, NVLINK_ALPHA * 8) and close(rs.latency, NVLINK_ALPHA * 8)
    bd = CostBreakdown((ag, rs))
    kinds = bd.by_kind()
    assert set(kinds) == {Collective.ALL_GATHER, Collective.REDUCE_SCATTER}
    assert close(kinds[Collective.ALL_GATHER], ag.total)
    assert close(sum(kinds.values()), bd.total)
    # an all-gather moves half the bytes of an all-reduce of the same N
    plain = CostOptions(latency=False, collective_efficiency=False)
    assert close(2 * collective_time("AG", out, node.axis(8), plain),
                 collective_time("AR", out, node.axis(8), plain))


def test_all_to_all_convention(node: Cluster) -> None:
    buf = 3 * 2**20
    t = collective_cost("A2A", buf, node.axis(8))
    assert close(t.transmission, NVLINK_BETA * 7 / 8 * buf * EPS["A2A"])


# ---- two nodes ----------------------------------------------------------------------------

def test_group_spanning_nodes_pays_ethernet() -> None:
    two = Cluster.v100_ethernet(num_nodes=2)
    assert two.num_devices == 16
    g16 = two.axis(16)
    assert g16.spans_nodes and g16.nodes == 2 and g16.link == two.inter
    g8 = two.axis(8)
    assert not g8.spans_nodes and g8.link == two.intra
    t16 = collective_cost("AR", ACT, two.axis(16))
    assert close(t16.latency, ETH_ALPHA * 16)
    assert close(t16.transmission, ETH_BETA * 2 * 15 / 16 * ACT * EPS["AR"])
    assert t16.nodes == 2
    t8 = collective_cost("AR", ACT, two.axis(8))
    assert close(t8.latency, NVLINK_ALPHA * 8)
    assert close(t8.transmission, NVLINK_BETA * 1.75 * ACT)
    # the same 8 workers spread over both nodes pay Ethernet
    t8x2 = collective_cost("AR", ACT, two.axis(8, 2))
    assert close(t8x2.transmission, ETH_BETA * 1.75 * ACT) and t8x2.nodes == 2
    assert t8x2.total > 10 * t8.total > 0


def test_group_placement_errors() -> None:
    two = Cluster.v100_ethernet(num_nodes=2)
    with pytest.raises(ValueError, match=r"size=17: .* only 16 devices"):
        two.axis(17)
    with pytest.raises(ValueError, match=r"nodes=1: a group of 16 .* 2 to 2 nodes"):
        two.axis(16, nodes=1)
    with pytest.raises(ValueError, match=r"size=0"):
        two.axis(0)


# ---- W = 1, validation --------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(Collective))
def test_single_worker_costs_zero(node: Cluster, kind: Collective) -> None:
    for backward in (False, True):
        t = collective_cost(kind, 2**30, node.axis(1), backward=backward)
        assert t.latency == 0.0 and t.transmission == 0.0 and t.total == 0.0
    assert collective_time(kind, 2**30, node.axis(1)) == 0.0
    assert ring_factor(kind, 1) == 0.0


def test_zero_bytes_pays_latency_only(node: Cluster) -> None:
    t = collective_cost("AR", 0, node.axis(8))
    assert t.transmission == 0.0 and close(t.latency, NVLINK_ALPHA * 8)


def test_invalid_cluster_messages() -> None:
    with pytest.raises(ValueError, match=r"num_nodes=0: a cluster needs at least one node; "
                                         r"use Cluster.single_node\(n\) for one machine"):
        Cluster.v100_ethernet(num_nodes=0)
    with pytest.raises(ValueError, match=r"num_nodes=-2"):
        Cluster.v100_ethernet(num_nodes=-2)
    with pytest.raises(ValueError, match=r"devices_per_node=0: a cluster with no devices"):
        Cluster.v100_ethernet(devices_per_node=0)
    with pytest.raises(ValueError, match=r"devices_per_node=-1"):
        Cluster.v100_ethernet(devices_per_node=-1)
    with pytest.raises(TypeError, match=r"num_nodes=2.5: must be an int"):
        Cluster.v100_ethernet(num_nodes=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nvlink.bandwidth=0: must be a positive"):
        Link(bandwidth=0, latency=1e-6, name="nvlink")
    with pytest.raises(ValueError, match=r"link.bandwidth=-1.0: must be a positive"):
        Link(bandwidth=-1.0, latency=1e-6)
    with pytest.raises(ValueError, match=r"latency=-1e-06"):
        Link(bandwidth=1e9, latency=-1e-6)
    node = Cluster.v100_ethernet()
    with pytest.raises(ValueError, match=r"device_memory=0"):
        dataclasses.replace(node, device_memory=0)
    with pytest.raises(ValueError, match=r"sources has unknown keys \['bandwith'\]"):
        dataclasses.replace(node, sources={"bandwith": "typo"})
    with pytest.raises(ValueError, match=r"devices=0"):
        Cluster.single_node(0)


def test_single_node_and_with_shape() -> None:
    one = Cluster.single_node(4)
    assert (one.num_nodes, one.devices_per_node) == (1, 4)
    assert one.intra == Cluster.v100_ethernet().intra
    cpu = Cluster.single_node(2, like=Cluster.loopback_cpu())
    assert cpu.intra == Cluster.loopback_cpu().intra and cpu.num_devices == 2
    assert hash(one) == hash(Cluster.single_node(4))


def test_invalid_options_messages(node: Cluster) -> None:
    with pytest.raises(ValueError, match=r"gamma=0: must be in \(0, 1\]"):
        CostOptions(gamma=0)
    with pytest.raises(ValueError, match=r"gamma=1.5"):
        CostOptions(gamma=1.5)
    with pytest.raises(ValueError, match=r"epsilon\['AG'\]=0: must be a positive, finite factor"):
        CostOptions(epsilon={"all_gather": 0})
    with pytest.raises(ValueError, match=r"epsilon\['RS'\]=inf"):
        CostOptions(epsilon={"RS": float("inf")})
    # a profiled epsilon may exceed 1 (the runtime's reduce-scatter is all-reduce + slice)
    assert CostOptions(epsilon={"RS": 2.0}).epsilon_for("RS") == 2.0
    with pytest.raises(ValueError, match=r"collective 'XX' is unknown"):
        CostOptions(epsilon={"XX": 0.5})
    with pytest.raises(TypeError, match=r"latency='yes'"):
        CostOptions(latency="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"collective 'broadcast' is unknown"):
        collective_cost("broadcast", 10, node.axis(2))
    with pytest.raises(ValueError, match=r"nbytes=-1"):
        collective_cost("AR", -1, node.axis(2))
    # a primitive left out of epsilon gets 1
    opts = CostOptions(epsilon={"AR": 0.5})
    assert opts.epsilon_for("A2A") == 1.0 and opts.epsilon_for("all_reduce") == 0.5


def test_collective_parse_names() -> None:
    assert Collective.parse("ar") is Collective.ALL_REDUCE
    assert Collective.parse("all-gather") is Collective.ALL_GATHER
    assert Collective.parse("REDUCE_SCATTER") is Collective.REDUCE_SCATTER
    assert Collective.parse(Collective.ALL_TO_ALL) is Collective.ALL_TO_ALL
    assert [k.value for k in Collective] == ["AR", "AG", "RS", "A2A"]
    assert str(Collective.ALL_TO_ALL) == "A2A"


def test_breakdown_is_frozen_and_addable(node: Cluster) -> None:
    a = collective_cost("AR", 1024, node.axis(8))
    b = collective_cost("AG", 1024, node.axis(8), backward=True)
    bd = CostBreakdown([a]) + [b]
    assert len(bd) == 2 and list(bd) == [a, b]
    assert close((bd + CostBreakdown([a])).total, 2 * a.total + b.total)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bd.terms = ()  # type: ignore[misc]
    assert isinstance(a, CostTerm) and CostBreakdown().total == 0.0


def test_module_does_not_import_tensorflow() -> None:
    code = ("import sys, tapas.planning.cost, tapas.planning.cluster; "
            "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- monotonicity -------------------------------------------------------------------------

kinds = st.sampled_from(list(Collective))
links = st.builds(Link, bandwidth=st.floats(1e6, 1e12), latency=st.floats(0.0, 1e-3))


def _cluster(link: Link, devices: int) -> Cluster:
    return Cluster("h", 1, devices, link, link, device_memory=1.0, device_peak_flops=1.0)


@settings(max_examples=200, deadline=None)
@given(kind=kinds, link=links, n1=st.integers(0, 2**40), n2=st.integers(0, 2**40),
       w=st.integers(1, 64), backward=st.booleans())
def test_monotone_in_bytes(kind, link, n1, n2, w, backward) -> None:
    c = _cluster(link, 64)
    lo, hi = sorted((n1, n2))
    assert collective_time(kind, lo, c.axis(w), backward=backward) <= \
        collective_time(kind, hi, c.axis(w), backward=backward)


@settings(max_examples=200, deadline=None)
@given(kind=kinds, link=links, n=st.integers(0, 2**40), w1=st.integers(1, 64),
       w2=st.integers(1, 64), latency=st.booleans())
def test_monotone_in_group_size(kind, link, n, w1, w2, latency) -> None:
    c = _cluster(link, 64)
    opts = CostOptions(latency=latency)
    lo, hi = sorted((w1, w2))
    assert collective_time(kind, n, c.axis(lo), opts) <= collective_time(kind, n, c.axis(hi), opts)


def test_module_doctest():
    import doctest
    from tapas.planning import cost as cost_module
    failures, tried = doctest.testmod(cost_module)
    assert tried > 0 and failures == 0


def test_cluster_module_doctest():
    import doctest
    from tapas.planning import cluster as cluster_module
    failures, tried = doctest.testmod(cluster_module)
    assert tried > 0 and failures == 0


def test_cluster_is_one_class_in_both_modules():
    from tapas.planning import cluster as cluster_module
    assert cost.Cluster is cluster_module.Cluster and cost.Link is cluster_module.Link
    assert cost.CLUSTER_PRESETS is cluster_module.CLUSTER_PRESETS


def test_cluster_presets_by_name():
    v = Cluster.preset("v100", 2, 4)
    assert (v.num_nodes, v.devices_per_node) == (2, 4)
    assert v.intra == Cluster.v100_ethernet().intra and v.inter == Cluster.v100_ethernet().inter
    c = Cluster.preset("cpu", 1, 2)
    assert c.intra == Cluster.loopback_cpu().intra and c.num_devices == 2
    with pytest.raises(ValueError, match="'tpu' is unknown: use one of"):
        Cluster.preset("tpu")


def test_compute_time_prices_memory_bound_ops_at_the_elementwise_rate(node: Cluster) -> None:
    """With a profiled elementwise rate, contractions run at the peak FLOP rate and the
    memory-bound ops' elements at the elementwise rate; without it (every preset), or with
    ``memory_bound`` off (the paper's rows), every FLOP at the peak rate."""
    flops, dense, elements = 3.0e9, 2.0e9, 1.0e9     # 1e9 of the flops were elementwise
    scale = 1.0 + CostOptions().backward_flops_factor
    assert close(cost.compute_time(flops, node, dense_flops=dense, elements=elements),
                 flops * scale / node.device_peak_flops)            # preset: no rate
    profiled = dataclasses.replace(node, device_elementwise_rate=5e10)
    assert close(cost.compute_time(flops, profiled, dense_flops=dense, elements=elements),
                 (dense / node.device_peak_flops + elements / 5e10) * scale)
    assert close(cost.compute_time(flops, profiled, CostOptions(memory_bound=False),
                                   dense_flops=dense, elements=elements),
                 flops * scale / node.device_peak_flops)
    assert not CostOptions.vanilla().memory_bound
    # a pattern that does not split its flops (a user's PatternsFn) keeps the FLOP pricing
    assert close(cost.compute_time(flops, profiled), flops * scale / node.device_peak_flops)
    assert cost.compute_time(flops, profiled, CostOptions(compute=False), dense_flops=dense,
                             elements=elements) == 0.0
    with pytest.raises(TypeError, match=r"memory_bound='yes'"):
        CostOptions(memory_bound="yes")  # type: ignore[arg-type]


def test_compute_time_prices_thin_matrix_multiplies_at_their_widths_rate(node: Cluster) -> None:
    """With a profiled FLOP rate by width, each width bucket's FLOPs run at the peak times
    the efficiency at the bucket's middle; FLOPs in no bucket (and every FLOP with
    ``gemm_width`` off or no table) at the peak."""
    peak, rate = node.device_peak_flops, 5e10
    table = {8: 0.25, 32: 0.75, 128: 1.0}
    profiled = dataclasses.replace(node, device_elementwise_rate=rate,
                                   device_width_efficiency=table)
    scale = 1.0 + CostOptions().backward_flops_factor
    dense, elements = 3.0e9, 1.0e9
    by_width = {8: 1.0e9, 256: 1.0e9}                  # and 1e9 in no bucket
    # bucket 8 is read at 8 * sqrt(2): a quarter of the way from 8 to 32 in log2
    eff8 = 0.25 + 0.25 * (0.75 - 0.25)
    assert close(profiled.flop_rate(8), peak * eff8)
    assert close(cost.compute_time(4e9, profiled, dense_flops=dense, elements=elements,
                                   dense_by_width=by_width),
                 ((1e9 / eff8 + 1e9 + 1e9) / peak + elements / rate) * scale)
    plain = ((dense / peak) + elements / rate) * scale
    assert close(cost.compute_time(4e9, profiled, CostOptions(gemm_width=False),
                                   dense_flops=dense, elements=elements,
                                   dense_by_width=by_width), plain)
    no_table = dataclasses.replace(profiled, device_width_efficiency=None)
    assert close(cost.compute_time(4e9, no_table, dense_flops=dense, elements=elements,
                                   dense_by_width=by_width), plain)
    with pytest.raises(TypeError, match=r"gemm_width=1"):
        CostOptions(gemm_width=1)  # type: ignore[arg-type]


def test_compute_scale_multiplies_every_compute_pricing(node: Cluster) -> None:
    """``compute_scale`` (a model's measured factor, ``calibrate_compute``) multiplies the
    compute time under each pricing (FLOPs at the peak, memory-bound, by width) and nothing
    else; it must be a positive, finite number."""
    profiled = dataclasses.replace(node, device_elementwise_rate=5e10,
                                   device_width_efficiency={8: 0.25, 128: 1.0})
    args = dict(dense_flops=2e9, elements=1e9, dense_by_width={8: 1e9})
    for cluster in (node, profiled):
        for base in (CostOptions(), CostOptions(memory_bound=False),
                     CostOptions(gemm_width=False)):
            scaled = dataclasses.replace(base, compute_scale=2.5)
            assert close(cost.compute_time(3e9, cluster, scaled, **args),
                         2.5 * cost.compute_time(3e9, cluster, base, **args))
    assert cost.compute_time(3e9, node, CostOptions(compute=False, compute_scale=3.0)) == 0.0
    # communication is not scaled
    assert cost.collective_cost("AR", 1 << 20, node.axis(4), CostOptions(compute_scale=3.0)) == \
        cost.collective_cost("AR", 1 << 20, node.axis(4), CostOptions())
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"compute_scale=.*must be a finite number > 0"):
            CostOptions(compute_scale=bad)  # type: ignore[arg-type]


def test_elementwise_scale_multiplies_only_the_memory_bound_part(node: Cluster) -> None:
    """``elementwise_scale`` (a model's measured factor for its memory-bound ops) multiplies
    the elements' time at the profiled rate and nothing else: not the contractions, not a
    measured kernel, not an op priced by FLOPs (memory_bound off, or no rate); it must be a
    positive, finite number."""
    rate, peak = 5e10, node.device_peak_flops
    profiled = dataclasses.replace(node, device_elementwise_rate=rate)
    args = dict(dense_flops=2e9, elements=1e9)
    base = cost.compute_time(3e9, profiled, CostOptions(gemm_width=False), **args)
    scaled = cost.compute_time(3e9, profiled, CostOptions(gemm_width=False,
                                                          elementwise_scale=4.0), **args)
    assert close(scaled - base, 3.0 * 1e9 / rate * 3.0)   # 3 more elements' times, x (1 + 2)
    assert close(base, (2e9 / peak + 1e9 / rate) * 3.0)
    for options in (CostOptions(memory_bound=False), CostOptions()):
        cluster = node if options.memory_bound else profiled
        assert cost.compute_time(3e9, cluster, dataclasses.replace(options,
                                                                   elementwise_scale=4.0),
                                 **args) == cost.compute_time(3e9, cluster, options, **args)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"elementwise_scale=.*must be a finite number"):
            CostOptions(elementwise_scale=bad)  # type: ignore[arg-type]


def test_gradient_flow_is_a_switch() -> None:
    """On by default (price only the backward collectives the step runs); a non-bool names
    the field and the values it takes."""
    assert CostOptions().gradient_flow is True
    assert CostOptions(gradient_flow=False).gradient_flow is False
    with pytest.raises(TypeError, match=r"gradient_flow='no': must be True or False"):
        CostOptions(gradient_flow="no")  # type: ignore[arg-type]
