"""The paper's Table 2: how well the cost model ranks strategies against measured step times.

    python scripts/table2_cost_model.py [--models=t5-tiny,keras-mobilenet,hub-mixtral,...]
        [--top_k=5] [--rounds=30] [--batch_size=64] [--[no]interleave] [--[no]paired]
        [--cluster=benchmarks/results/cluster_cpu4_2026-11-26_epyc.json] [--out=out/table2]
    python scripts/table2_cost_model.py --recost=out/table2/table2.json   # no measuring
    python scripts/table2_cost_model.py --kernels_only --models=...       # kernel times only
    python scripts/table2_cost_model.py --communication_only --models=... # +CS factors only
    python scripts/table2_cost_model.py --workers=2 --cluster=cluster_workers2.json ...

For each model (default: 15 architectures, 5 transformers, 6 CNNs, 4 MoE, among them
keras.applications and keras-hub models from ``tapas.models.corpus``), in one process with 4
logical CPU devices (``--devices``):

1. ``tapas.search`` on the profiled cluster (``--cluster``, a ``tapas profile`` file) with
   every cost term on returns the top ``--top_k`` plans and the reference plans
   (Megatron, FFN-only, MHA-only, expert, data parallel, replicate, those that apply), and
   the same search pricing the model's loss its top ``--top_k`` (``L#1``...); plans with
   identical patterns are merged.
2. Each distinct plan is reconstructed (``tapas.parallelize`` with a hand-made
   ``tapas.execution.program.plan.Plan``, inference graph as ``benchmarks/bench_train.py``) and
   stepped once (tracing). With ``--interleave`` (the default) all of a model's plans are
   built first and their ``train_step`` timed round-robin (``report.timed_round_robin``):
   ``--rounds`` rounds, each stepping every plan once in a shuffled order; a plan is
   ranked by the median of its steps relative to the same round's steps of the plans
   timed in every round (their geometric mean), times that yardstick's median: the
   machine's speed drifting over the model's minutes moves every plan alike. After
   ``--drop_after`` rounds a plan over ``--drop_ratio`` times the fastest stops being timed
   (its steps so far kept), so the rounds go to the plans whose order is in question;
   after ``--refine_after`` rounds a second cut keeps only the plans within
   ``--refine_ratio`` of the fastest (10 %), which get the remaining rounds to themselves:
   the plans the ranking's first places are decided among are timed the most.
   ``--twin`` (the default): the model's first plan is built a second time and timed in
   the same rounds, not ranked: how far two builds of one plan measure apart (``twins`` in
   the JSON); neither build is cut (runs before 2026-11-28 could cut one after 5 rounds,
   whose gap then compared 5 steps with 30). ``--nointerleave``: each plan built and timed
   in turn, ``--repeats`` rounds
   of ``--steps`` steps; with ``--paired`` every timed step is paired with a step of the
   replicated plan, kept built beside it, and the plan is ranked by the median ratio of
   the pairs times the replicated plan's median (the method of the runs before
   2026-11-27, evening); ``--nopaired``: plain medians, ties within the interquartile
   range of the steps (the first run's method). Two plans tie when they differ by less
   than 5 % (``--tie_tol``) or the standard error of either's median.
3. The same plans are re-costed (``tapas.planning.explore.plan_cost``, no rerun) under the
   ablation rows: baseline (constant filter, gradient overlap and collective efficiency
   off), +CF, +CF+GO, +CF+GO+EC, and beyond the paper +CF+GO+EC+WR (a weight read in two
   placements priced as the runtime reshards it), +CF+GO+EC+WR+L (also the training
   loss's collectives), +CF+GO+EC+WR+L+MB (also memory-bound ops priced by their
   elements at the cluster's profiled elementwise rate; the same as the row before with a
   cluster file that has no such rate) and +CF+GO+EC+WR+L+MB+W (also each matrix multiply
   at the profiled FLOP rate of its width: the search's default; the same as the row
   before with a cluster file that has no such rates), +CF+GO+EC+WR+L+MB+W+MC (also
   every plan's compute times the model's own factor, measured first: see below) and
   +CF+GO+EC+WR+L+MB+W+K (the search's default row with each contraction and convolution
   priced by its kernel's measured time: see below) and +CF+GO+EC+WR+L+MB+W+K+CS (also
   every collective's cost times the model's own measured factor: see below), and ranked;
   ``tapas.planning.ranking`` scores the rank of the
   measured-best plan (measured ties within noise count for the model, predicted ties with
   a plan outside the measured-best set against it; with every predicted tie against it,
   the rule before 2026-11-28, beside: ``strict_ties`` in the JSON).

``--calibrate`` (the default): before its plans, each model's compute factor is measured
(``tapas.execution.calibration.compute_scale.calibrate_compute``: the replicated program's step at the
global batch and at batch / N, ``--steps`` x ``--repeats`` pairs, against the compute the
cost model prices for them; no plan is run) for the row +MC, and the search with that
factor adds its own top ``--top_k`` (``C#1``...); ``calibrations`` in the JSON, kept by
``--recost`` (which re-derives each factor for its ``--cluster``; a file without them is
re-costed without the row).

``--calibrate_communication`` (the default, with ``--kernels``): before its plans, each
model's communication factor is measured (``tapas.execution.calibration.communication_scale``: its
data-parallel plan's step as it runs and with every collective replaced by a local op,
``--steps`` x ``--repeats`` pairs, against what the cost model prices for its collectives)
for the row +CS, and the search pricing the kernels with that factor adds its own top
``--top_k`` (``S#1``...). The same calibration times a second plan, one of mostly activation
collectives, in the same rounds, and solves a factor for weight gradients' collectives and
one for the others (``CostOptions.activation_communication_scale``) for the row +CA, whose
search adds its own top ``--top_k`` (``A#1``...; where the second plan gave no factor, +CA is
+CS). The data-parallel plan's step without its collectives is all compute: over the compute
the row +K prices for that plan it gives the model's compute factor over the measured
kernels, which the row +CA+U adds to +CA (``collective_free_factor``; its search adds
``U#1``...). With ``--calibrate`` too, the compute calibration's difference of two batch
sizes beyond the +K price of the contractions' and convolutions' difference, over the price
of the memory-bound ops' difference, gives the factor the row +CA+E multiplies only those
ops' time by (``elementwise_factor``, ``CostOptions.elementwise_scale``; ``elementwise``
of each model's ``calibrations``; its search adds ``E#1``...). ``communication_calibrations``
in the JSON (with the timed plans' patterns: ``--recost`` re-derives each factor for its
``--cluster``). ``--communication_only`` measures them and writes
``table2_communication.json``; ``--recost --communication=table2_communication.json`` prices
an earlier run's plans with them. One process only (not with ``--workers``: the row is left
out there).

``--kernels`` (the default): before its plans, every kernel the model's patterns run (each
contraction and convolution at its local shapes: ``tapas.planning.kernel_times``) is timed
on the devices (``tapas.execution.calibration.kernels``) for the row +K, and the search pricing them
adds its own top ``--top_k`` (``K#1``...); ``kernel_times`` in the JSON. ``--kernels_only``
times them and writes ``table2_kernels.json`` without running a plan; ``--recost
--kernel_times=table2_kernels.json`` prices an earlier run's plans with them.

Prints the table beside the paper's, writes ``table2.json`` and one scatter PNG per row of
predicted against measured step time (the cost model's seconds are for the profiled
constants; a least-squares scale through the origin maps them onto measured seconds, and the
plot says the scale) with the y = x line. A plan that fails to build or run is reported
with its error and left out of the ranking.

``--decompose``: each plan is also built with its collectives replaced by local ops of the
same shape (``benchmarks/report.without_communication``, a timing instrument whose numbers
are wrong) and that copy's step is timed in the same pairs: the plan's step minus the copy's
is what its collectives cost inside the step, the copy's step is its compute, data movement
and dispatch. Printed and written (``decomposition`` in the JSON, ``table2_decomposition.png``)
against the cost model's communication and compute of each plan: where the model
mispredicts, this says which half. With it, two predictors that each know one half from the
measurement (measured compute + the model's communication; the model's compute + measured
communication) are scored like the table's rows (``oracles``): how far fixing that half
alone would go. One process only (not with ``--workers``).

``--ceiling=other/table2.json``: another run of the same models; its measured times rank
this run's plans (matched by their patterns) and are scored like a cost model: how well a
model that knew every plan's time from one run could do on another, i.e. the ceiling the
measurement noise leaves (``ceiling`` in the JSON; also with ``--recost``).

``--workers=K``: the same run on a second cluster, K processes on 127.0.0.1 under
``MultiWorkerMirroredStrategy`` with one device each (``tapas.execution.runtime.launch`` starts
them with this command and always stops them). Every worker builds, searches and steps the
same plans in the same order (the collectives keep them in step); worker 0's timings are
the measurement and it alone writes ``--out``.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

from absl import app, flags, logging  # noqa: E402

import report  # noqa: E402  (benchmarks/report.py: the timed training step)

flags.DEFINE_integer("devices", 4, "Logical CPU devices.")
flags.DEFINE_integer("workers", 0, "Time the plans on this many processes on 127.0.0.1 under "
                     "MultiWorkerMirroredStrategy (one device each: the second cluster) "
                     "instead of logical devices; --cluster must then be a `tapas profile "
                     "--workers=K` file.")
# 15 architectures as the paper's table (5 transformers, 6 CNNs, 4 MoE), each small enough
# to time every plan here; keras.applications (keras-*) and keras-hub (hub-*) models are
# from tapas.models.corpus: written by other people. t5-small (60 M parameters: its plans
# take about 30 minutes of timed steps) runs with --models=t5-small
MODELS = ["t5-tiny", "t5-tiny-tapas", "t5-tiny-masked", "bert-tiny", "llama-tiny",
          "resnet-tiny", "keras-mobilenet", "keras-mobilenet-v2", "keras-mobilenet-v3",
          "keras-efficientnet", "keras-resnet",
          "moe-tiny", "moe-tiny-tapas", "hub-mixtral", "hub-qwen3-moe"]
flags.DEFINE_list("models", MODELS, "Zoo presets (tapas models) or corpus models "
                  "(tapas.models.corpus: keras-*, hub-*).")
flags.DEFINE_boolean("paired", True, "Time each plan's steps paired with the replicated "
                     "plan's (one step of each in turn) and rank by the ratio times the "
                     "replicated plan's median: load drifting between plans cancels out. "
                     "--nopaired: plain medians, each plan timed alone.")
flags.DEFINE_boolean("interleave", True, "Build all of a model's plans first, then time "
                     "them round-robin (--rounds rounds, every plan once per round in a "
                     "shuffled order) and rank each by its steps relative to the same "
                     "rounds' steps of the others: the machine's speed drifting moves every "
                     "plan alike. --nointerleave: one plan after another (--paired).")
flags.DEFINE_boolean("twin", True, "With --interleave: each model's first plan is built a "
                     "second time and timed in the same rounds (not ranked): how far two "
                     "builds of one plan measure apart (`twin` in the JSON).")
flags.DEFINE_integer("rounds", 50, "With --interleave: rounds (timed steps per plan).")
flags.DEFINE_integer("drop_after", 5, "With --interleave: after this many rounds, plans over "
                     "--drop_ratio times the fastest stop being timed.")
flags.DEFINE_float("drop_ratio", 1.5, "With --interleave: see --drop_after (0: time every plan "
                   "every round; always so with --workers).")
flags.DEFINE_integer("refine_after", 30, "With --interleave: after this many rounds, plans over "
                     "--refine_ratio times the fastest stop too, so the close plans get the "
                     "remaining rounds (0: no second cut).")
flags.DEFINE_float("refine_ratio", 1.1, "With --interleave: see --refine_after (0: none "
                   "stops; always so with --workers).")
flags.DEFINE_integer("top_k", 5, "Top plans of the search to run (plus the reference plans).")
flags.DEFINE_integer("steps", 5, "Timed steps per round of the calibrations (and of each "
                     "plan with --nointerleave).")
flags.DEFINE_integer("repeats", 2, "Rounds of --steps timed steps of the calibrations (and "
                     "of each plan with --nointerleave).")
flags.DEFINE_integer("batch_size", 64, "Global batch (divisible by --devices). 64: at 8 the "
                     "plans of these small models lie within the measurement's own noise of "
                     "each other (docs/paper.md, \"Table 2 at batch 64\").")
flags.DEFINE_boolean("calibrate", True, "Measure each model's compute factor first "
                     "(tapas.execution.calibration.compute_scale: the replicated step at the batch and at "
                     "batch / N, --steps x --repeats pairs) for the row +CF+GO+EC+WR+L+MB+W+MC.")
flags.DEFINE_boolean("kernels", True, "Time each model's kernels first (every contraction and "
                     "convolution at its local shapes under each pattern: "
                     "tapas.execution.calibration.kernels) for the row +CF+GO+EC+WR+L+MB+W+K.")
flags.DEFINE_boolean("calibrate_communication", True, "Measure each model's communication "
                     "factor first (tapas.execution.calibration.communication_scale: its data-parallel "
                     "plan's step with and without its collectives, --steps x --repeats "
                     "pairs) for the row +CF+GO+EC+WR+L+MB+W+K+CS (with --kernels). Not with "
                     "--workers.")
flags.DEFINE_boolean("kernels_only", False, "Time each model's kernels and write "
                     "table2_kernels.json, nothing else (no plan is run): for --recost "
                     "--kernel_times of an earlier run's plans.")
flags.DEFINE_string("kernel_times", None, "With --recost: a table2_kernels.json (or a "
                    "table2.json) whose kernel times price the row +K (default: "
                    "the re-costed file's own).")
flags.DEFINE_boolean("communication_only", False, "Measure each model's communication factor "
                     "(the row +CS's calibration) and write table2_communication.json, "
                     "nothing else (no kernel timed, no plan run): for --recost "
                     "--communication of an earlier run's plans.")
flags.DEFINE_string("communication", None, "With --recost: a table2_communication.json (or a "
                    "table2.json) whose communication calibrations price the row +CS "
                    "(default: the re-costed file's own).")
flags.DEFINE_float("tie_tol", 0.05, "Relative tolerance under which measured times tie.")
flags.DEFINE_string("cluster", "benchmarks/results/cluster_cpu4_2026-11-26_epyc.json",
                    "A cluster file written by `tapas profile`.")
flags.DEFINE_string("recost", None, "Re-cost the runs of an earlier table2.json (its plans, "
                    "measured medians and spreads) under every row of this script, without "
                    "measuring again (e.g. after a cost-model change); writes "
                    "table2_recost.json.")
flags.DEFINE_boolean("decompose", False, "Also time each plan with its collectives replaced "
                     "by local ops (benchmarks/report.without_communication): measured "
                     "communication and compute beside the model's. Not with --workers.")
flags.DEFINE_string("ceiling", None, "Another run's table2.json of the same models: its "
                    "measured times used as the predictor of this run's (plans matched by "
                    "their patterns), the score a perfect model could expect given how far "
                    "measurements move between runs.")
flags.DEFINE_string("out", "out/table2", "Directory for table2.json and the PNGs.")
FLAGS = flags.FLAGS

PAPER = {"baseline": {"acc@1": 0.53, "mrr": 0.71}, "+CF+GO+EC": {"acc@1": 0.87, "acc@5": 1.0,
                                                                  "mrr": 0.92}}
_PAPER_TERMS = dict(memory_bound=False)   # every op's FLOPs at the matmul rate
MC_ROW = "+CF+GO+EC+WR+L+MB+W+MC"
K_ROW = "+CF+GO+EC+WR+L+MB+W+K"
CS_ROW = K_ROW + "+CS"
CA_ROW = CS_ROW + "+CA"
CU_ROW = CA_ROW + "+U"
CE_ROW = CA_ROW + "+E"


class Communication(NamedTuple):
    """A model's measured factors: one for every collective (``one``), the weight
    gradients' and the activations' of two plans (``activations`` None when not measured),
    the compute factor of the same calibration's collective-free step
    (``collective_free_factor``) and the memory-bound ops' factor of the compute
    calibration (``elementwise_factor``)."""

    one: float = 1.0
    gradients: float = 1.0
    activations: float | None = None
    compute: float = 1.0
    elementwise: float = 1.0


NO_COMMUNICATION = Communication()
ROWS = {"baseline": dict(constant_filter=False, gradient_overlap=False,
                         collective_efficiency=False, **_PAPER_TERMS),
        "+CF": dict(constant_filter=True, gradient_overlap=False, collective_efficiency=False,
                    **_PAPER_TERMS),
        "+CF+GO": dict(constant_filter=True, gradient_overlap=True, collective_efficiency=False,
                       **_PAPER_TERMS),
        "+CF+GO+EC": dict(constant_filter=True, gradient_overlap=True,
                          collective_efficiency=True, **_PAPER_TERMS),
        # beyond the paper: a weight read in two placements (a tied embedding) priced as
        # the runtime moves it (CostOptions.weight_reshards)
        "+CF+GO+EC+WR": dict(constant_filter=True, gradient_overlap=True,
                             collective_efficiency=True, weight_reshards=True, **_PAPER_TERMS),
        # ... and the training loss's collectives on the output's placement (the model's
        # Keras loss: CostOptions.loss, as `tapas search` and `tapas train` price it)
        "+CF+GO+EC+WR+L": dict(constant_filter=True, gradient_overlap=True,
                               collective_efficiency=True, weight_reshards=True, loss=True,
                               **_PAPER_TERMS),
        # ... and memory-bound ops priced by their elements at the profiled elementwise rate
        # (CostOptions.memory_bound; the same as the row above on a cluster file without
        # that rate)
        "+CF+GO+EC+WR+L+MB": dict(constant_filter=True, gradient_overlap=True,
                                  collective_efficiency=True, weight_reshards=True, loss=True,
                                  memory_bound=True, gemm_width=False),
        # ... and each matrix multiply at the profiled FLOP rate of its width on one device
        # (CostOptions.gemm_width; the same as the row above on a cluster file without
        # device_width_efficiency): the search's default
        "+CF+GO+EC+WR+L+MB+W": dict(constant_filter=True, gradient_overlap=True,
                                    collective_efficiency=True, weight_reshards=True,
                                    loss=True, memory_bound=True, gemm_width=True),
        # ... and every plan's compute times the model's own measured factor
        # (CostOptions.compute_scale, tapas.execution.calibration.compute_scale: the replicated step at
        # the global batch and at batch / N against what the row above prices for them);
        # "measured" stands for that model's factor
        MC_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                     weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                     compute_scale="measured"),
        # the search's default row with each contraction's and convolution's kernel priced
        # by its measured training-step time at its local shapes (CostOptions.kernel_times,
        # tapas.execution.calibration.kernels); "measured" stands for that model's kernel times
        K_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                    weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                    kernel_times="measured"),
        # ... and every collective's cost times the model's own measured factor
        # (CostOptions.communication_scale, tapas.execution.calibration.communication_scale: its
        # data-parallel plan's step with and without its collectives against what this row
        # prices for them); "measured" stands for that model's factor
        CS_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                     weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                     kernel_times="measured", communication_scale="measured"),
        # ... with two factors instead of one: the weight gradients' collectives and the
        # others' (CostOptions.activation_communication_scale), solved from the
        # data-parallel plan and a second plan of mostly activation collectives timed in
        # the same calibration; the row above where the second plan gave no factor
        CA_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                     weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                     kernel_times="measured", communication_scale="measured",
                     activation_communication_scale="measured"),
        # ... and every plan's compute times the model's compute factor over the measured
        # kernels: the same calibration's data-parallel step without its collectives (a step
        # that is all compute) over the compute the row +K prices for that plan
        # (CostOptions.compute_scale; ``collective_free_factor``)
        CU_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                     weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                     kernel_times="measured", communication_scale="measured",
                     activation_communication_scale="measured",
                     compute_scale="collective-free"),
        # ... or, instead of all compute, only the memory-bound ops' time times the model's
        # factor: from its compute calibration (the replicated step at B and B / N), the
        # measured difference beyond the +K price of its contractions' and convolutions'
        # difference, over the price of its memory-bound ops' difference
        # (CostOptions.elementwise_scale, ``elementwise_factor``; needs --calibrate)
        CE_ROW: dict(constant_filter=True, gradient_overlap=True, collective_efficiency=True,
                     weight_reshards=True, loss=True, memory_bound=True, gemm_width=True,
                     kernel_times="measured", communication_scale="measured",
                     activation_communication_scale="measured",
                     elementwise_scale="measured")}


def two_factors(communication: Communication) -> dict:
    """``CostOptions`` changes of the rows that price collectives by two factors: the weight
    gradients' and the activations' where both were measured, else the one factor."""
    if communication.activations is None:
        return {"communication_scale": communication.one,
                "activation_communication_scale": None}
    return {"communication_scale": communication.gradients,
            "activation_communication_scale": communication.activations}


def candidates(graph, cluster, top_k: int, loss=None,
               compute_scale: float | None = None, kernel_times=None,
               communication: Communication | None = None) -> list[dict]:
    """The distinct plans to run: the search's top ``top_k`` and its reference plans, each
    ``{"names": [...], "patterns": (pattern name per GraphNode)}``; with ``loss``, also the
    top ``top_k`` of the search that prices it (named ``L#1``...); with ``compute_scale``
    (the model's measured factor), also the top ``top_k`` of the search that prices the loss
    and scales compute by it (``C#1``...), with ``kernel_times`` (the model's measured
    kernels) the top ``top_k`` of the search that prices them (``K#1``...), with both
    ``kernel_times`` and ``communication`` (the model's measured factors,
    ``Communication``) the top ``top_k`` of the search that prices the kernels and scales
    collectives by the one factor (``S#1``..., when it is not 1.0), of the one that
    scales them by the two factors (``A#1``..., when the activations' was measured) and of
    the one that also scales compute by the collective-free step's factor (``U#1``..., when
    it is not 1.0) and of the one that scales the memory-bound ops by the model's factor for
    them (``E#1``..., when it is not 1.0), so each row's first choice is measured."""
    from tapas.planning.cost import CostOptions
    from tapas.planning.search import search
    out: dict[tuple[str, ...], list[str]] = {}
    searches = [("", None, None)]
    if loss is not None:
        searches.append(("L", loss, None))
    if compute_scale is not None:
        searches.append(("C", loss, CostOptions.for_cluster(cluster,
                                                             compute_scale=compute_scale)))
    if kernel_times is not None:
        searches.append(("K", loss, CostOptions.for_cluster(cluster,
                                                             kernel_times=kernel_times)))
    if kernel_times is not None and communication is not None and communication.one != 1.0:
        # (at 1.0 it is the search above: no second search)
        searches.append(("S", loss, CostOptions.for_cluster(
            cluster, kernel_times=kernel_times, communication_scale=communication.one)))
    if kernel_times is not None and communication is not None and \
            communication.activations is not None:
        searches.append(("A", loss, CostOptions.for_cluster(
            cluster, kernel_times=kernel_times, **two_factors(communication))))
    if kernel_times is not None and communication is not None and communication.compute != 1.0:
        searches.append(("U", loss, CostOptions.for_cluster(
            cluster, kernel_times=kernel_times, compute_scale=communication.compute,
            **two_factors(communication))))
    if kernel_times is not None and communication is not None and \
            communication.elementwise != 1.0:
        searches.append(("E", loss, CostOptions.for_cluster(
            cluster, kernel_times=kernel_times, elementwise_scale=communication.elementwise,
            **two_factors(communication))))
    for prefix, priced, options in searches:
        s = search(graph, cluster=cluster, top_k=top_k, loss=priced, options=options)
        alts = list(s.alternatives)[:top_k] + ([] if prefix else list(s.references))
        for alt in alts:
            if alt.error:
                continue
            pats = tuple(alt.changes.get(v, p) for v, p in enumerate(s.patterns))
            out.setdefault(pats, []).append(prefix + alt.name
                                            if alt.name.startswith("#") else alt.name)
    return [{"names": names, "patterns": pats} for pats, names in out.items()]


def plan_costs(graph, cluster, plans: list[dict], loss, row: str,
               compute_scale: float = 1.0, kernel_times=None,
               communication: Communication = NO_COMMUNICATION) -> list:
    """The ``PlanCost`` (communication, compute, memory) of every plan under one ablation
    row; ``loss`` (the model's Keras loss) is priced when the row says ``loss=True``, and
    ``compute_scale`` (the model's measured factor), ``kernel_times`` (its measured
    kernels) and ``communication`` (its measured factors, ``Communication``) where it says
    ``"measured"``."""
    from tapas.planning import explore as ex
    from tapas.planning.cost import CostOptions
    from tapas.planning.table import EdgeCoster, pattern_table
    n = cluster.num_devices
    changes = dict(ROWS[row])
    changes["loss"] = loss if changes.get("loss") else None
    if changes.get("compute_scale") == "measured":
        changes["compute_scale"] = compute_scale
    elif changes.get("compute_scale") == "collective-free":
        changes["compute_scale"] = communication.compute
    if changes.get("elementwise_scale") == "measured":
        changes["elementwise_scale"] = communication.elementwise
    if changes.get("kernel_times") == "measured":
        changes["kernel_times"] = kernel_times
    if changes.get("communication_scale") == "measured":
        changes["communication_scale"] = communication.one
        if changes.pop("activation_communication_scale", None) == "measured":
            changes.update(two_factors(communication))
    opts = CostOptions.for_cluster(cluster, **changes)
    table = pattern_table(graph, n, cluster, opts)
    edges = EdgeCoster(n, cluster, opts)
    costs = []
    for plan in plans:
        idx = []
        for v, name in enumerate(plan["patterns"]):
            names = [i.name for i in table.infos[v]]
            if name not in names:
                raise ValueError(f"row {row}: GraphNode {v} has no pattern {name!r} (has "
                                 f"{names}); the plan cannot be re-costed")
            idx.append(names.index(name))
        costs.append(ex.plan_cost(graph, table, idx, edges)[0])
    return costs


def recost(graph, cluster, plans: list[dict], loss, compute_scale: float = 1.0,
           kernel_times=None, communication: Communication = NO_COMMUNICATION
           ) -> dict[str, list[float]]:
    """Each ablation row's predicted step time (seconds) of every plan (``plan_costs``)."""
    return {row: [c.total for c in plan_costs(graph, cluster, plans, loss, row, compute_scale,
                                              kernel_times, communication)]
            for row in ROWS}


W_ROW = "+CF+GO+EC+WR+L+MB+W"


def parts_row() -> str:
    """The row whose communication and compute ``--decompose`` sets beside the measured
    ones: the calibrated row when the run has it, else ``W_ROW``."""
    return MC_ROW if MC_ROW in ROWS else W_ROW


def drop_calibrated_row(why: str) -> None:
    """Leave ``MC_ROW`` and ``CE_ROW`` (whose factor is of the same calibration) out of this
    run's table (no measured compute factors: ``why``)."""
    for row in (MC_ROW, CE_ROW):
        if ROWS.pop(row, None) is not None:
            print(f"note: no row {row}: {why}", flush=True)


def drop_kernel_row(why: str) -> None:
    """Leave ``K_ROW`` (and ``CS_ROW``, ``CA_ROW``, ``CU_ROW``, ``CE_ROW``, which price the
    kernels too) out of this run's table (no measured kernels: ``why``)."""
    if ROWS.pop(K_ROW, None) is not None:
        print(f"note: no row {K_ROW}: {why}", flush=True)
    drop_communication_row(why)


def drop_communication_row(why: str) -> None:
    """Leave ``CS_ROW``, ``CA_ROW``, ``CU_ROW`` and ``CE_ROW`` out of this run's table (no
    measured communication factors: ``why``)."""
    for row in (CS_ROW, CA_ROW, CU_ROW, CE_ROW):
        if ROWS.pop(row, None) is not None:
            print(f"note: no row {row}: {why}", flush=True)


def model_communication(model, entry, graph, cluster, strategy, loss, kernels,
                        name: str) -> dict:
    """One model's communication calibration (``tapas.execution.calibration.communication_scale``) as
    JSON, with the patterns of the plan it timed (for ``--recost`` with another cluster);
    an error is reported and leaves the model's factor at 1.0."""
    from tapas.execution.calibration.communication_scale import calibrate_communication
    from tapas.planning.cost import CostOptions
    options = CostOptions.for_cluster(cluster, loss=loss, kernel_times=kernels)
    try:
        cal = calibrate_communication(model, _specs(entry, FLAGS.batch_size), cluster=cluster,
                                      distribute_strategy=strategy, loss=loss, training=False,
                                      options=options, graph=graph, steps=FLAGS.steps,
                                      repeats=FLAGS.repeats)
    except Exception as e:  # noqa: BLE001  (reported; the model's row keeps 1.0)
        out = {"error": f"{type(e).__name__}: {str(e)[:400]}", "scale": None,
               "communication_scale": 1.0}
        print(f"[{name}] communication calibration FAILED (scale 1.0): {out['error']}",
              flush=True)
        return out
    print(f"[{name}] {cal.describe()}", flush=True)
    return cal.to_json()


def collective_free_factor(calibration: dict | None, graph, cluster, loss, kernels) -> float:
    """A model's compute factor over the measured kernels (the row ``CU_ROW``): its
    communication calibration's data-parallel step without its collectives (all compute)
    over the compute ``K_ROW`` prices for that plan; 1.0 without a calibration or kernels.
    On this project's Xeon VM the cost model priced that step's compute at 0.41-0.79 of what
    it measured, by a factor that depends on the model; the row it gives is an experiment
    (measured on four models it ranked worse than +CA: docs/paper.md)."""
    if not calibration or kernels is None or not calibration.get("measured_s") or \
            not calibration.get("patterns"):
        return 1.0
    cost = plan_costs(graph, cluster, [{"patterns": tuple(calibration["patterns"])}], loss,
                      K_ROW, kernel_times=kernels)[0]
    return calibration["measured_s"][1] / cost.compute if cost.compute > 0 else 1.0


def elementwise_factor(calibration: dict | None, entry, graph, cluster, kernels) -> dict:
    """A model's factor for its memory-bound ops (the row ``CE_ROW``), from its compute
    calibration (``--calibrate``: the replicated step at the global batch B and at B / N,
    ``tapas.execution.calibration.compute_scale``) re-priced as ``K_ROW`` prices (measured kernels):
    ``ComputeCalibration.elementwise_scale``, the measured difference of the two steps less
    the priced difference of their contractions and convolutions, over the priced
    difference of their memory-bound ops. A difference cancels what both steps pay whatever
    their size (each op's launch, the step's dispatch), which no plan can save.
    ``{"factor": ..., "rest_s": [B, B / N], "elements_s": [B, B / N]}`` (the two parts of
    the replicated program's +K compute at each batch); factor 1.0 without a calibration
    (or one whose difference was within its noise), kernels or an elementwise rate (no
    parts), or when the priced difference leaves nothing to explain."""
    if not calibration or calibration.get("scale") is None or kernels is None or \
            not cluster.device_elementwise_rate:
        return {"factor": 1.0, "rest_s": None, "elements_s": None}
    from tapas.execution.calibration.compute_scale import ComputeCalibration, replicated_compute_parts
    from tapas.planning.cost import CostOptions
    big, small = calibration["batches"]
    n = cluster.num_devices
    options = CostOptions.for_cluster(cluster, kernel_times=kernels, **{
        k: v for k, v in ROWS[K_ROW].items() if k not in ("loss", "kernel_times")})
    graphs = (graph, graph_at(entry, big, big // small))
    whole, elements = zip(*(replicated_compute_parts(g, n, cluster, options)
                            for g in graphs))
    cal = ComputeCalibration(n, (big, small), tuple(calibration["measured_s"]),
                             (whole[0], whole[1]), calibration["difference_s"],
                             calibration["difference_se_s"], calibration["pairs"],
                             calibration["scale"], "", (elements[0], elements[1]))
    return {"factor": cal.elementwise_scale,
            "rest_s": [w - e for w, e in zip(whole, elements)], "elements_s": list(elements)}


def graph_at(entry, batch: int, rows: int):
    """The model's graph captured at global batch ``batch`` / ``rows`` (its inputs' batch
    axis divided as ``calibrate_compute`` divides it; a corpus model is built for one batch,
    so its specs at ``batch`` are the ones divided)."""
    from tapas import capturing
    from tapas.execution.runtime.inputs import InputSignature
    model = entry.build(fast_init=True)
    small = InputSignature.of(model, _specs(entry, batch)).per_row(rows, "the calibration's "
                                                                    "second batch")
    return capturing.capture(model, small.spec_structure(), training=False)


def comm_rescaled(calibration: dict | None, graph, cluster, loss, kernels,
                  e: float = 1.0) -> Communication:
    """A model's communication factors (``Communication``) from its stored calibration,
    re-derived for ``cluster`` (the measured differences over what this cluster's constants
    price for the same plans' collectives); ``NO_COMMUNICATION`` without one. ``e``: the
    model's ``elementwise_factor``, re-derived by the caller."""
    u = collective_free_factor(calibration, graph, cluster, loss, kernels)
    if not calibration or calibration.get("scale") is None:
        return Communication(compute=u, elementwise=e)
    from tapas.execution.calibration.communication_scale import predicted_parts, solve_factors
    from tapas.planning.cost import CostOptions
    options = CostOptions.for_cluster(cluster, loss=loss, kernel_times=kernels)
    first, _ = predicted_parts(graph, calibration["patterns"], cluster, options)
    one = calibration["difference_s"] / sum(first) if sum(first) > 0 else 1.0
    second = calibration.get("activation") or {}
    if second.get("scale") is not None:
        parts, _ = predicted_parts(graph, second["patterns"], cluster, options)
        both = solve_factors(first, calibration["difference_s"], parts,
                             second["difference_s"])
        if both is not None:
            return Communication(one, both[0], both[1], u, e)
    return Communication(one, one, None, u, e)


def comm_factors(calibration: dict | None, compute_factor: float = 1.0,
                 elementwise: float = 1.0) -> Communication:
    """A model's communication factors (``Communication``) as its calibration measured
    them: one factor is the data-parallel plan's difference over its price;
    ``compute_factor``: ``collective_free_factor`` of the same calibration,
    ``elementwise``: the model's ``elementwise_factor`` (of its compute calibration)."""
    if not calibration or calibration.get("scale") is None:
        return Communication(compute=compute_factor, elementwise=elementwise)
    one = calibration["difference_s"] / calibration["predicted_s"]
    if calibration.get("activation_communication_scale") is None:
        return Communication(one, one, None, compute_factor, elementwise)
    return Communication(one, calibration["communication_scale"],
                         calibration["activation_communication_scale"], compute_factor,
                         elementwise)


def model_kernels(graph, strategy, name: str):
    """The measured kernel times of one model's patterns (``tapas.execution.calibration.kernels``)."""
    from tapas.execution.calibration.kernels import measure_kernels
    from tapas.planning.kernel_times import graph_kernels
    keys = graph_kernels(graph, strategy.num_replicas_in_sync)
    return measure_kernels(keys, strategy, progress=lambda line: print(f"[{name}] {line}",
                                                                       flush=True))


def predicted_parts(graph, cluster, plans: list[dict], loss,
                    compute_scale: float = 1.0) -> list[dict[str, float]]:
    """Each plan's predicted communication and compute (seconds), row :func:`parts_row`."""
    return [{"communication_s": c.communication, "compute_s": c.compute}
            for c in plan_costs(graph, cluster, plans, loss, parts_row(), compute_scale)]


def decomposition(runs: list[dict], tie_tol: float) -> dict | None:
    """Measured against predicted communication and compute over the runs timed with
    ``--decompose`` (None when none was). Communication: the median over plans with
    collectives of measured / predicted. Compute: per model, the least-squares slope of the
    measured compute (the local copy's step) against the predicted compute over its plans
    (the intercept is what every plan pays: dispatch, per-op work), its median over models;
    a slope of k means the compute a plan saves by sharding costs k times what the model
    prices it at. ``oracles``: the ranking scores when one half of the model is replaced by
    its measurement (:func:`half_oracles`), which says how far fixing that half alone
    would go."""
    done = [r for r in runs if "measured_compute_s" in r and "predicted_parts" in r]
    if not done:
        return None
    ratios = [r["measured_communication_s"] / r["predicted_parts"]["communication_s"]
              for r in done if r["predicted_parts"]["communication_s"] > 0]
    slopes = {}
    for model in dict.fromkeys(r["model"] for r in done):
        pts = [(r["predicted_parts"]["compute_s"], r["measured_compute_s"]) for r in done
               if r["model"] == model]
        xs = [p for p, _ in pts]
        mx = sum(xs) / len(xs)
        var = sum((x - mx) ** 2 for x in xs)
        if len(pts) < 2 or var <= (1e-3 * mx) ** 2:   # the plans' compute is all the same
            continue
        my = sum(m for _, m in pts) / len(pts)
        slopes[model] = sum((x - mx) * (m - my) for x, m in pts) / var
    out = {"row": parts_row(), "plans": len(done),
           "communication_ratio_median": statistics.median(ratios) if ratios else None,
           "communication_ratios": ratios, "compute_slopes": slopes,
           "compute_slope_median": statistics.median(slopes.values()) if slopes else None}
    out["oracles"] = half_oracles(done, tie_tol)
    comm = out["communication_ratio_median"]
    slope = out["compute_slope_median"]
    print(f"\ndecomposition ({len(done)} plans, cost model {parts_row()}): measured / predicted "
          f"communication, median over plans with collectives: "
          f"{'-' if comm is None else f'{comm:.2f}'}; measured compute against predicted, "
          f"slope over each model's plans, median over models: "
          f"{'-' if slope is None else f'{slope:.2f}'}")
    for model, k in slopes.items():
        print(f"  {model:<22} compute slope {k:6.2f}")
    for name, o in out["oracles"].items():
        print(f"  {name}: Acc@1 {o['acc@1']:.2f}, Acc@5 {o['acc@5']:.2f}, MRR {o['mrr']:.2f} "
              f"({o['models']} models)")
    return out


#: the predictors of :func:`half_oracles`: (name, compute, communication) of a run, each
#: "measured" (the --decompose timings) or "model" (predicted_parts)
ORACLES = (("measured compute + model communication", "measured", "model"),
           ("model compute + measured communication", "model", "measured"))


def predictor_ranks(runs: list[dict], predict: Callable[[dict], float | None],
                    tie_tol: float) -> tuple[dict[str, int], dict[str, float]]:
    """Per model, the rank ``predict`` (a run -> predicted time, None to leave the run out)
    gives the measured-best plan, and the pick regret, ranked against the measured times
    and ties as the table's rows are; models with fewer than two predicted runs are left
    out."""
    from tapas.planning import ranking
    ranks, regrets = {}, {}
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [(r, predict(r)) for r in runs if r["model"] == model and "error" not in r]
        mine = [(r, p) for r, p in mine if p is not None]
        if len(mine) < 2:
            continue
        medians, spreads = (list(x) for x in zip(*(measured(r) for r, _ in mine)))
        pred = [p for _, p in mine]
        ranks[model] = ranking.best_rank(medians, pred, spreads, tie_tol)
        regrets[model] = ranking.pick_regret(medians, pred)
    return ranks, regrets


def half_oracles(runs: list[dict], tie_tol: float) -> dict[str, dict]:
    """Acc@1, Acc@5 and MRR of two predictors that know half of each plan's step from the
    measurement: the measured compute (the local copy's step) plus the model's
    communication, and the model's compute plus the measured communication (a negative
    measured part, noise around zero, counts as 0). Ranked against the same measured times
    and ties as the table; models with fewer than two decomposed plans are left out."""
    from tapas.planning import ranking
    out = {}
    for name, compute, communication in ORACLES:
        def predict(r: dict, compute: str = compute, communication: str = communication
                    ) -> float:
            return max(0.0, (r["measured_compute_s"] if compute == "measured"
                             else r["predicted_parts"]["compute_s"])
                       + (r["measured_communication_s"] if communication == "measured"
                          else r["predicted_parts"]["communication_s"]))
        ranks, _ = predictor_ranks(runs, predict, tie_tol)
        if ranks:
            out[name] = {**ranking.table_metrics(ranks, 5), "ranks": ranks}
    return out


def ceiling(runs: list[dict], other_path: str, tie_tol: float) -> dict | None:
    """``--ceiling``: Acc@1, Acc@5, MRR and picks within 10 % when another run's measured
    times (``other_path``) rank this run's plans, matched by their patterns; models with
    fewer than two matched plans are left out. Two runs of the same plans disagree by the
    measurement noise, which no cost model can beat."""
    from tapas.planning import ranking
    with open(other_path) as f:
        other = {(r["model"], tuple(r["patterns"])): r for r in json.load(f)["runs"]
                 if "error" not in r and "patterns" in r}

    def theirs(r: dict) -> float | None:
        match = other.get((r["model"], tuple(r["patterns"])))
        return None if match is None else measured(match)[0]
    ranks, regrets = predictor_ranks(runs, theirs, tie_tol)
    if not ranks:   # said, not raised: the run's own results are still written
        print(f"\nceiling: {other_path} has no model with two plans in common with this run "
              "(plans are matched by their patterns): no ceiling", flush=True)
        return None
    out = {**ranking.table_metrics(ranks, 5), "ranks": ranks, "pick_regret": regrets,
           "picks_within_10pct": sum(r <= 0.10 for r in regrets.values()),
           "other": other_path}
    print(f"\nceiling: {other_path}'s measurements as the predictor of this run's "
          f"({out['models']} models): Acc@1 {out['acc@1']:.2f}, Acc@5 {out['acc@5']:.2f}, "
          f"MRR {out['mrr']:.2f}, picks within 10 % {out['picks_within_10pct']}/{out['models']}")
    return out


def plot_decomposition(runs: list[dict], path: str) -> None:
    """Two panels: predicted against measured communication, and compute, every plan."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in runs if "measured_compute_s" in r and "predicted_parts" in r]
    if not done:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    colors = plt.get_cmap("tab20").colors
    for ax, part, measured_key in ((axes[0], "communication_s", "measured_communication_s"),
                                   (axes[1], "compute_s", "measured_compute_s")):
        values = []
        for i, model in enumerate(sorted({r["model"] for r in done})):
            pts = [(r["predicted_parts"][part] * 1e3, r[measured_key] * 1e3) for r in done
                   if r["model"] == model]
            values += [v for p in pts for v in p]
            ax.scatter(*zip(*pts), label=model, s=18, color=colors[i % len(colors)],
                       marker="os^D"[i // len(colors) % 4])
        lo, hi = min(values + [0.0]), max(values + [1e-3])
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
        ax.set_xlabel(f"predicted {part[:-2]} (ms, {parts_row()})")
        ax.set_ylabel(f"measured {part[:-2]} (ms)")
        ax.set_title(f"{part[:-2]} per step: model against measured")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(model, entry, graph, plan: dict, strategy, anchor) -> dict:
    """Median, interquartile range and all step times of one plan's ``train_step`` (and
    its ratio to ``anchor``'s steps, when given: ``benchmarks/report.timed_plan``)."""
    return report.timed_plan(model, entry, graph, plan["patterns"], strategy,
                             FLAGS.batch_size, FLAGS.steps, FLAGS.repeats, anchor=anchor,
                             decompose=FLAGS.decompose)


def failed(run: dict, error: Exception, where: str) -> None:
    """Record a plan that failed to build or run (reported, left out of the ranking)."""
    run["error"] = f"{type(error).__name__}: {str(error)[:400]}"
    print(f"{where} {run['plan']}: FAILED {run['error']}", flush=True)


def interleaved(model, entry, graph, todo: list[tuple[dict, dict]], strategy, workers: int,
                name: str) -> list[dict]:
    """``--interleave``: every plan of ``todo`` ((plan, run) pairs) built first, then timed
    round-robin (``benchmarks/report.timed_round_robin``: ``--rounds`` rounds, each plan
    once per round in a shuffled order, ranked against the same rounds' steps of the
    others; after ``--drop_after`` rounds a plan over ``--drop_ratio`` times the fastest
    stops, after ``--refine_after`` one over ``--refine_ratio``, except across worker
    processes). Fills each run; returns those timed."""
    built = []
    for i, (plan, run) in enumerate(todo):
        try:
            program = report.plan_program(model, entry, graph, plan["patterns"], strategy,
                                          FLAGS.batch_size)
            local = None
            if FLAGS.decompose:
                with report.without_communication():
                    local = report.plan_program(model, entry, graph, plan["patterns"],
                                                strategy, FLAGS.batch_size)
        except Exception as e:  # noqa: BLE001  (reported with the plan; the run goes on)
            failed(run, e, f"[{name} {i + 1}/{len(todo)}]")
            continue
        built.append((run, program, local))
    if not built:
        return []
    twin = None
    if FLAGS.twin:   # the first plan built a second time: how far two builds of one plan
        try:
            twin = report.plan_program(model, entry, graph, built[0][0]["patterns"],
                                       strategy, FLAGS.batch_size)
        except Exception as e:  # noqa: BLE001  (an instrument: the run goes on without it)
            print(f"[{name}] {built[0][0]['plan']} built a second time: FAILED "
                  f"{type(e).__name__}: {str(e)[:400]}", flush=True)
    print(f"[{name}] {len(built)} plans built; timing {FLAGS.rounds} rounds", flush=True)
    programs = [p for _, p, _ in built] + ([twin] if twin is not None else [])
    locals_ = [lp for _, _, lp in built] + [None] * (twin is not None)
    results = report.timed_round_robin(
        programs, FLAGS.rounds, drop_after=FLAGS.drop_after,
        drop_ratio=FLAGS.drop_ratio if workers == 1 else 0.0,
        refine_after=FLAGS.refine_after,
        refine_ratio=FLAGS.refine_ratio if workers == 1 else 0.0,
        local_programs=locals_ if FLAGS.decompose else None,
        keep=(0, len(programs) - 1) if twin is not None else ())
    if twin is not None:
        first, again = results[0], results.pop()
        if "error" not in first and "error" not in again:
            built[0][0]["twin"] = {k: again[k] for k in ("paired_s", "paired_se_s", "rounds",
                                                         "times_s")}
            gap = again["paired_s"] / first["paired_s"] - 1
            print(f"[{name}] {built[0][0]['plan']} built twice: {first['paired_s'] * 1e3:.1f} "
                  f"and {again['paired_s'] * 1e3:.1f} ms ({gap:+.1%})", flush=True)
    mine = []
    for (run, _, _), result in zip(built, results):
        if "error" in result:
            failed(run, RuntimeError(result["error"]), f"[{name}]")
            continue
        run.update(result)
        mine.append(run)
    del built
    gc.collect()
    return mine


class CorpusModel:
    """A model of ``tapas.models.corpus`` (another library's) with the zoo entry's
    interface that the timed step reads: built once at ``batch``, its loss (sparse
    cross-entropy of a keras.applications classifier, MSE of a backbone's output) and one
    synthetic batch in the model's own input structure (a dict for keras-hub)."""

    def __init__(self, name: str, batch: int) -> None:
        from tapas.models import corpus
        self.entry = corpus.get(name)
        self.batch = batch
        self.model, self.specs = self.entry.build(batch)
        self.xs, self.y = self.entry.synthetic_batch(self.model, self.specs)

    def build(self, seed: int = 0, fast_init: bool = False):
        del seed, fast_init   # corpus models are built with seed 0, once
        return self.model

    def input_spec(self, batch_size: int | None = None):
        self._check(batch_size)
        return self.specs

    def synthetic_batch(self, batch_size: int | None = None):
        self._check(batch_size)
        return self.xs, self.y

    def keras_loss(self):
        return self.entry.loss()

    def _check(self, batch_size: int | None) -> None:
        if batch_size not in (None, self.batch):
            raise ValueError(f"{self.entry.name} was built for batch {self.batch}, not "
                             f"{batch_size}")


def model_entry(name: str, batch: int):
    """A zoo preset's entry, or a corpus model as :class:`CorpusModel`."""
    from tapas import models
    return models.get(name) if name in models.names() else CorpusModel(name, batch)


def _specs(entry, batch: int):
    specs = entry.input_spec(batch)
    return list(specs) if isinstance(specs, tuple) else specs


def measured(run: dict) -> tuple[float, float]:
    """The step time a run is ranked by and the noise within which two plans tie: paired
    (ratio to the replicated plan, times that plan's median; the standard error of that
    median) when measured so, else (older runs) the plain median and its IQR."""
    if "paired_s" in run:
        return run["paired_s"], run["paired_se_s"]
    return run["median_s"], run["iqr_s"]


def scale_of(pred: list[float], meas: list[float]) -> float:
    """Least-squares scale through the origin mapping predicted onto measured seconds."""
    den = sum(p * p for p in pred)
    return sum(p * m for p, m in zip(pred, meas)) / den if den > 0 else 1.0


def plot(rows: list[dict], row: str, path: str) -> float:
    """Scatter of (scaled) predicted against measured step time of every run; the scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pred = [r["predicted_s"][row] for r in rows]
    meas = [measured(r)[0] for r in rows]
    s = scale_of(pred, meas)
    fig, ax = plt.subplots(figsize=(5, 5))
    colors = plt.get_cmap("tab20").colors
    for i, model in enumerate(sorted({r["model"] for r in rows})):
        pts = [(r["predicted_s"][row] * s * 1e3, measured(r)[0] * 1e3) for r in rows
               if r["model"] == model]
        ax.scatter(*zip(*pts), label=model, s=18, color=colors[i % len(colors)],
                   marker="os^D"[i // len(colors) % 4])
    # log axes: the models' steps span 10 ms to half a second
    values = [v for v in meas + [p * s for p in pred] if v > 0]
    lo, hi = min(values) * 1e3 / 1.2, max(values) * 1e3 * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"predicted step time x {s:.3g} (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title(f"Table 2 runs, cost model\n{row}", fontsize="medium")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return s


def _slug(row: str) -> str:
    """A file-name form of an ablation row: "+CF+GO" -> "CF_GO"."""
    return row.strip("+").replace("+", "_")


def rank_table(ranks: dict, regrets: dict, taus: dict, strict: dict | None = None) -> dict:
    """Acc@1, Acc@5, MRR per ablation row, printed beside the paper's, how often the row's
    pick runs within 10 % of the measured best (``regrets[row][model]``: its
    ``ranking.pick_regret``) and the mean Kendall tau of the whole predicted order against
    the measured one (``taus[row][model]``: ``ranking.kendall_tau``; beyond the paper).
    ``strict[row][model]``: the ranks with every predicted tie against the model (the rule
    of the runs before 2026-11-28, ``ranking.best_rank(strict_ties=True)``), their Acc@1,
    Acc@5 and MRR kept beside and printed where they differ."""
    from tapas.planning import ranking
    table = {}
    for row in ROWS:
        known = [t for t in taus[row].values() if t is not None]
        table[row] = {**ranking.table_metrics(ranks[row], 5), "ranks": ranks[row],
                      "pick_regret": regrets[row],
                      "picks_within_10pct": sum(r <= 0.10 for r in regrets[row].values()),
                      "taus": taus[row],
                      "tau": sum(known) / len(known) if known else None}
        if strict and strict.get(row):
            m = ranking.table_metrics(strict[row], 5)
            table[row]["strict_ties"] = {"acc@1": m["acc@1"], "acc@5": m["acc@5"],
                                         "mrr": m["mrr"], "ranks": strict[row]}
    print(f"\n{'row':<24} {'Acc@1':>6} {'Acc@5':>6} {'MRR':>6} {'pick<=10%':>10} {'worst':>6}"
          f" {'tau':>5}   paper Acc@1 Acc@5 MRR")
    for row, t in table.items():
        p = PAPER.get(row, {})
        worst = max(t["pick_regret"].values())
        tau = "-" if t["tau"] is None else f"{t['tau']:.2f}"
        print(f"{row:<24} {t['acc@1']:>6.2f} {t['acc@5']:>6.2f} {t['mrr']:>6.2f} "
              f"{t['picks_within_10pct']:>5}/{t['models']:<4} {worst * 100:>5.0f}% {tau:>5}   "
              f"{p.get('acc@1', '-'):>11} {p.get('acc@5', '-'):>5} {p.get('mrr', '-'):>4}")
    moved = [(row, t) for row, t in table.items() if "strict_ties" in t
             and t["strict_ties"]["ranks"] != t["ranks"]]
    if moved:
        print("with every predicted tie against the model, measured-best or not (the rule "
              "before 2026-11-28):")
        for row, t in moved:
            s = t["strict_ties"]
            print(f"{row:<24} {s['acc@1']:>6.2f} {s['acc@5']:>6.2f} {s['mrr']:>6.2f}")
    return table


def score(ranks: dict, regrets: dict, taus: dict, name: str, mine: list[dict],
          predicted: dict[str, list[float]], tie_tol: float,
          strict: dict | None = None) -> None:
    """Fill ``ranks[row][name]``, ``regrets[row][name]`` and ``taus[row][name]`` (and
    ``strict[row][name]``, the rank with every predicted tie against the model) for the
    runs ``mine`` of one model under each row's predictions."""
    from tapas.planning import ranking
    medians, spreads = (list(x) for x in zip(*(measured(r) for r in mine)))
    for row in ROWS:
        ranks[row][name] = ranking.best_rank(medians, predicted[row], spreads, tie_tol)
        if strict is not None:
            strict.setdefault(row, {})[name] = ranking.best_rank(
                medians, predicted[row], spreads, tie_tol, strict_ties=True)
        regrets[row][name] = ranking.pick_regret(medians, predicted[row])
        taus[row][name] = ranking.kendall_tau(medians, predicted[row])


def recost_file(path: str) -> None:
    """--recost: the plans of an earlier run (its patterns, or the same search again when
    the file has none), re-costed under every row of ROWS, ranked against the medians it
    measured."""
    from tapas import capturing
    from tapas.planning.cluster import Cluster
    with open(path) as f:
        old = json.load(f)
    # the run's own cluster file, unless --cluster names another (re-costing with new
    # constants, e.g. a profile taken on a quieter machine)
    cluster_file = FLAGS.cluster if FLAGS["cluster"].present else old.get("cluster",
                                                                           FLAGS.cluster)
    cluster = Cluster.load(cluster_file)
    batch = int(old.get("batch_size", FLAGS.batch_size))
    calibrations = old.get("calibrations") or {}
    from tapas.planning.kernel_times import KernelTimes
    kernel_source = old
    if FLAGS.kernel_times:
        with open(FLAGS.kernel_times) as f:
            kernel_source = json.load(f)
    kernels = {m: KernelTimes.from_json(d)
               for m, d in (kernel_source.get("kernel_times") or {}).items()}
    if not kernels:
        drop_kernel_row(f"{FLAGS.kernel_times or path} has no measured kernel times")
    comm_source = old
    if FLAGS.communication:
        with open(FLAGS.communication) as f:
            comm_source = json.load(f)
    comm_calibrations = comm_source.get("communication_calibrations") or {}
    if not comm_calibrations:
        drop_communication_row(f"{FLAGS.communication or path} has no measured communication "
                               "factors")
    if not calibrations:
        drop_calibrated_row(f"{path} has no measured compute factors (a run before "
                            "--calibrate, or with --nocalibrate)")
    ranks: dict = {row: {} for row in ROWS}
    regrets: dict = {row: {} for row in ROWS}
    taus: dict = {row: {} for row in ROWS}
    strict: dict = {row: {} for row in ROWS}
    runs = []
    names = list(dict.fromkeys(r["model"] for r in old["runs"]))
    for name in names:
        runs.extend(r for r in old["runs"] if r["model"] == name and "error" in r)
        mine = [r for r in old["runs"] if r["model"] == name and "error" not in r]
        if not mine:
            continue
        entry = model_entry(name, batch)
        graph = capturing.capture(entry.build(fast_init=True), _specs(entry, batch),
                                  training=False)
        if all("patterns" in r for r in mine):
            plans = [{"names": r["plan"].split("/"), "patterns": tuple(r["patterns"])}
                     for r in mine]
        else:   # an older file: the search is deterministic, so the same plans come back
            by_label = {"/".join(p["names"]): p
                        for p in candidates(graph, cluster, int(old["top_k"]))}
            missing = [r["plan"] for r in mine if r["plan"] not in by_label]
            if missing:
                raise ValueError(f"{path}: the plans {missing} of {name} are not what the "
                                 "search returns today and the file has no patterns: "
                                 "measure again")
            plans = [by_label[r["plan"]] for r in mine]
        scale = rescaled(calibrations.get(name), graph, cluster)
        if K_ROW in ROWS and name not in kernels:
            raise ValueError(f"{FLAGS.kernel_times or path} has no kernel times of {name}: "
                             "measure them (--kernels_only --models=...)")
        if CS_ROW in ROWS and name not in comm_calibrations:
            raise ValueError(f"{FLAGS.communication or path} has no communication calibration "
                             f"of {name}: measure it (--communication_only --models=...)")
        e = (elementwise_factor(calibrations.get(name), entry, graph, cluster,
                                kernels.get(name))["factor"]
             if CE_ROW in ROWS else 1.0)
        comm = (comm_rescaled(comm_calibrations.get(name), graph, cluster, entry.keras_loss(),
                              kernels.get(name), e) if CS_ROW in ROWS else NO_COMMUNICATION)
        predicted = recost(graph, cluster, plans, entry.keras_loss(), scale, kernels.get(name),
                           comm)
        parts = (predicted_parts(graph, cluster, plans, entry.keras_loss(), scale)
                 if any("measured_compute_s" in r for r in mine) else None)
        for i, r in enumerate(mine):
            runs.append({**r, "predicted_s": {row: predicted[row][i] for row in ROWS},
                         **({"predicted_parts": parts[i]} if parts else {})})
        score(ranks, regrets, taus, name, mine, predicted,
              float(old.get("tie_tol", FLAGS.tie_tol)), strict)
        print(f"{name}: rank of the measured-best plan "
              + ", ".join(f"{row} {ranks[row][name]}" for row in ROWS), flush=True)
    table = rank_table(ranks, regrets, taus, strict)
    os.makedirs(FLAGS.out, exist_ok=True)
    timed = [r for r in runs if "error" not in r]
    scales = {row: plot(timed, row, os.path.join(FLAGS.out, f"table2_scatter_{_slug(row)}.png"))
              for row in ROWS}
    tie_tol = float(old.get("tie_tol", FLAGS.tie_tol))
    parts_summary = decomposition(timed, tie_tol)
    if parts_summary is not None:
        plot_decomposition(timed, os.path.join(FLAGS.out, "table2_decomposition.png"))
    bound = ceiling(timed, FLAGS.ceiling, tie_tol) if FLAGS.ceiling else old.get("ceiling")
    out = {**old, "recosted_from": path, "cluster": cluster_file, "rows": ROWS, "table": table,
           "kernel_times": {m: k.to_json() for m, k in kernels.items()},
           "communication_calibrations": comm_calibrations,
           "scatter_scale": scales, "decomposition": parts_summary, "ceiling": bound,
           "runs": runs,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv)}
    dest = os.path.join(FLAGS.out, "table2_recost.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nre-costed (not measured again); written to {dest}")


def rescaled(calibration: dict | None, graph, cluster) -> float:
    """A model's compute factor from its stored calibration, re-derived for ``cluster``
    (the measured difference over the difference this cluster's rates price: re-costing
    with another profile changes the prediction, not the measurement; the batch / N
    program's price is taken in the stored proportion to the full batch's, which is exact
    for the run's own cluster); 1.0 without one."""
    if not calibration or calibration.get("scale") is None:
        return 1.0
    from tapas.planning.cost import CostOptions
    from tapas.execution.calibration.compute_scale import predicted_replicated_compute
    n = cluster.num_devices
    options = CostOptions.for_cluster(cluster, **{k: v for k, v in ROWS[W_ROW].items()
                                                  if k != "loss"})
    big = predicted_replicated_compute(graph, n, cluster, options)
    small = calibration["predicted_s"][1] * big / calibration["predicted_s"][0]
    return calibration["difference_s"] / (big - small) if big > small else 1.0


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.ceiling and not os.path.isfile(FLAGS.ceiling):
        raise app.UsageError(f"--ceiling={FLAGS.ceiling}: no such file; give the table2.json "
                             "of another run of the same models")
    # the measurements --recost can take from another file: (flag, what a measuring run
    # does instead, the flag that writes such a file)
    for name, own, writer in (("kernel_times", "times its own kernels", "--kernels_only"),
                              ("communication", "calibrates its own", "--communication_only")):
        value = FLAGS[name].value
        if value and not FLAGS.recost:
            raise app.UsageError(f"--{name}={value} prices the plans of "
                                 f"--recost=table2.json; a measuring run {own}")
        if value and not os.path.isfile(value):
            raise app.UsageError(f"--{name}={value}: no such file; write one with {writer} "
                                 "--models=...")
    if FLAGS.rounds < 1:
        raise app.UsageError(f"--rounds={FLAGS.rounds}: time each plan in at least 1 round")
    if FLAGS.refine_ratio and FLAGS.refine_ratio < 1:
        raise app.UsageError(f"--refine_ratio={FLAGS.refine_ratio}: give 0 (no second cut) "
                             "or a ratio >= 1 to the fastest plan")
    if FLAGS.refine_after < 0:
        raise app.UsageError(f"--refine_after={FLAGS.refine_after}: give 0 (no second cut) "
                             "or a number of rounds")
    if FLAGS.drop_ratio and FLAGS.drop_ratio < 1:
        raise app.UsageError(f"--drop_ratio={FLAGS.drop_ratio}: give 0 (time every plan "
                             "every round) or a ratio >= 1 to the fastest plan")
    if FLAGS.recost:
        recost_file(FLAGS.recost)
        return
    from tapas.execution.runtime import devices
    if FLAGS.workers:
        if FLAGS.communication_only:
            raise app.UsageError("--communication_only times plans without their "
                                 "collectives, which worker processes cannot run: run it on "
                                 "--devices, without --workers")
        if FLAGS.decompose:
            raise app.UsageError("--decompose times each plan without its collectives, "
                                 "which worker processes cannot run (their steps would no "
                                 "longer meet): run it on --devices, without --workers")
        launch_workers()
        return
    workers = devices.process_count()
    chief = devices.is_chief_process()
    if workers == 1:
        devices.setup_devices(FLAGS.devices, "cpu")
    from tapas import capturing
    from tapas.planning.cluster import Cluster
    n = FLAGS.devices
    cluster = Cluster.load(FLAGS.cluster)
    if cluster.num_devices != n:
        how = (f"tapas profile --workers={n}" if workers > 1 else
               f"tapas profile --devices={n}")
        raise ValueError(f"--cluster={FLAGS.cluster} has {cluster.num_devices} devices but "
                         f"the run has {n}: profile with `{how}`")
    strategy = devices.make_strategy(n)
    from tapas.execution.calibration.compute_scale import calibrate_compute, median_standard_error
    calibrations: dict[str, dict] = {}
    if not FLAGS.calibrate:
        drop_calibrated_row("--nocalibrate")
    kernel_times: dict[str, dict] = {}
    if FLAGS.kernels_only:
        for name in FLAGS.models:
            entry = model_entry(name, FLAGS.batch_size)
            graph = capturing.capture(entry.build(fast_init=True),
                                      _specs(entry, FLAGS.batch_size), training=False)
            kernel_times[name] = model_kernels(graph, strategy, name).to_json()
        if chief:
            os.makedirs(FLAGS.out, exist_ok=True)
            dest = os.path.join(FLAGS.out, "table2_kernels.json")
            with open(dest, "w") as f:
                json.dump({"command": " ".join(sys.argv), "batch_size": FLAGS.batch_size,
                           "devices": n, "workers": workers, "kernel_times": kernel_times},
                          f, indent=1)
            print(f"written to {dest}")
        return
    comm_calibrations: dict[str, dict] = {}
    if FLAGS.communication_only:
        for name in FLAGS.models:
            entry = model_entry(name, FLAGS.batch_size)
            model = entry.build(seed=0)
            graph = capturing.capture(model, _specs(entry, FLAGS.batch_size), training=False)
            comm_calibrations[name] = model_communication(model, entry, graph, cluster,
                                                          strategy, entry.keras_loss(), None,
                                                          name)
        os.makedirs(FLAGS.out, exist_ok=True)
        dest = os.path.join(FLAGS.out, "table2_communication.json")
        with open(dest, "w") as f:
            json.dump({"command": " ".join(sys.argv), "batch_size": FLAGS.batch_size,
                       "devices": n, "cluster": FLAGS.cluster,
                       "communication_calibrations": comm_calibrations}, f, indent=1)
        print(f"written to {dest}")
        return
    if not FLAGS.kernels:
        drop_kernel_row("--nokernels")
    if not FLAGS.calibrate_communication:
        drop_communication_row("--nocalibrate_communication")
    elif workers > 1:
        drop_communication_row("worker processes cannot run a plan without its collectives")
    runs, ranks, regrets = [], {row: {} for row in ROWS}, {row: {} for row in ROWS}
    taus: dict = {row: {} for row in ROWS}
    strict: dict = {row: {} for row in ROWS}
    load_before = os.getloadavg()
    for name in FLAGS.models:
        entry = model_entry(name, FLAGS.batch_size)
        model = entry.build(seed=0)
        graph = capturing.capture(model, _specs(entry, FLAGS.batch_size), training=False)
        loss = entry.keras_loss()
        scale = None
        if FLAGS.calibrate:
            try:
                cal = calibrate_compute(model, _specs(entry, FLAGS.batch_size),
                                        cluster=cluster, distribute_strategy=strategy,
                                        loss=loss, training=False, steps=FLAGS.steps,
                                        repeats=FLAGS.repeats)
            except Exception as e:  # noqa: BLE001  (reported; the model's row keeps 1.0)
                calibrations[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                      "scale": None, "compute_scale": 1.0}
                print(f"[{name}] calibration FAILED (compute scale 1.0): "
                      f"{calibrations[name]['error']}", flush=True)
            else:
                calibrations[name] = cal.to_json()
                scale = cal.compute_scale
                print(f"[{name}] {cal.describe()}", flush=True)
        kernels = None
        if FLAGS.kernels:
            kernels = model_kernels(graph, strategy, name)
            kernel_times[name] = kernels.to_json()
        comm = None
        if CS_ROW in ROWS:
            comm_calibrations[name] = model_communication(model, entry, graph, cluster,
                                                          strategy, loss, kernels, name)
            u = collective_free_factor(comm_calibrations[name], graph, cluster, loss, kernels)
            comm_calibrations[name]["collective_free_factor"] = u
            e = 1.0
            if CE_ROW in ROWS:
                parts = elementwise_factor(calibrations.get(name), entry, graph, cluster,
                                           kernels)
                calibrations[name]["elementwise"] = parts
                e = parts["factor"]
            comm = comm_factors(comm_calibrations[name], u, e)
        plans = candidates(graph, cluster, FLAGS.top_k, loss, scale, kernels, comm)
        predicted = recost(graph, cluster, plans, loss, scale or 1.0, kernels,
                           comm or NO_COMMUNICATION)
        parts = (predicted_parts(graph, cluster, plans, loss, scale or 1.0)
                 if FLAGS.decompose else None)
        anchor = None
        todo = []
        for i, plan in enumerate(plans):
            run = {"model": name, "plan": "/".join(plan["names"]),
                   "patterns": list(plan["patterns"]),
                   "sharded_nodes": sum(p != "replicate" for p in plan["patterns"]),
                   "predicted_s": {row: predicted[row][i] for row in ROWS}}
            if parts is not None:
                run["predicted_parts"] = parts[i]
            runs.append(run)
            todo.append((plan, run))
        if FLAGS.interleave:
            mine = interleaved(model, entry, graph, todo, strategy, workers, name)
        else:
            anchor = (report.plan_program(model, entry, graph,
                                          ["replicate"] * len(graph.nodes), strategy,
                                          FLAGS.batch_size) if FLAGS.paired else None)
            mine = []
            for i, (plan, run) in enumerate(todo):
                try:
                    run.update(measure(model, entry, graph, plan, strategy, anchor))
                except Exception as e:  # noqa: BLE001  (reported with the plan; goes on)
                    failed(run, e, f"[{name} {i + 1}/{len(plans)}]")
                    continue
                mine.append(run)
        if anchor is not None and mine:   # one scale for the model: the anchor's median
            base = statistics.median(t for r in mine for t in r["anchor_times_s"])
            for r in mine:
                # the spread that decides a measured tie: the standard error of the median
                # ratio, not the steps' spread
                se = median_standard_error(r["ratio_iqr"], len(r["times_s"]))
                r.update(paired_s=r["ratio"] * base, paired_iqr_s=r["ratio_iqr"] * base,
                         paired_se_s=se * base)
        for r in mine:
            if "local_median_s" in r:   # --decompose: the step without its collectives
                yardstick = r.get("round_s", base if anchor is not None else None)
                local = (r["local_ratio"] * yardstick if "local_ratio" in r and yardstick
                         else r["local_median_s"])
                r.update(measured_compute_s=local,
                         measured_communication_s=measured(r)[0] - local)
        for i, r in enumerate(mine):
            t, spread = measured(r)
            print(f"[{name} {i + 1}/{len(mine)}] {r['plan']}: measured {t * 1e3:.1f} ms "
                  f"(+-{spread * 1e3:.1f}; alone {r['median_s'] * 1e3:.1f}), predicted "
                  f"{r['predicted_s']['+CF+GO+EC'] * 1e3:.2f} ms (+CF+GO+EC), "
                  f"{r['predicted_s']['+CF+GO+EC+WR+L'] * 1e3:.2f} ms (+WR+L), "
                  f"{r['predicted_s']['+CF+GO+EC+WR+L+MB'] * 1e3:.2f} ms (+MB), "
                  f"{r['predicted_s'][W_ROW] * 1e3:.2f} ms (+MB+W)"
                  + (f", {r['predicted_s'][MC_ROW] * 1e3:.2f} ms (+MC)" if MC_ROW in ROWS
                     else "")
                  + (f", {r['predicted_s'][K_ROW] * 1e3:.2f} ms (+K)" if K_ROW in ROWS
                     else "")
                  + (f", {r['predicted_s'][CS_ROW] * 1e3:.2f} ms (+CS)" if CS_ROW in ROWS
                     else "")
                  + (f", {r['predicted_s'][CA_ROW] * 1e3:.2f} ms (+CA)" if CA_ROW in ROWS
                     else "")
                  + (f", {r['predicted_s'][CU_ROW] * 1e3:.2f} ms (+U)" if CU_ROW in ROWS
                     else "")
                  + (f", {r['predicted_s'][CE_ROW] * 1e3:.2f} ms (+E)" if CE_ROW in ROWS
                     else "")
                  + (f"; communication {r['measured_communication_s'] * 1e3:.1f} ms measured, "
                     f"{r['predicted_parts']['communication_s'] * 1e3:.1f} predicted; compute "
                     f"{r['measured_compute_s'] * 1e3:.1f} ms measured, "
                     f"{r['predicted_parts']['compute_s'] * 1e3:.1f} predicted"
                     if "measured_compute_s" in r else ""), flush=True)
        if not mine:
            continue
        score(ranks, regrets, taus, name, mine,
              {row: [r["predicted_s"][row] for r in mine] for row in ROWS}, FLAGS.tie_tol,
              strict)
        del anchor
        gc.collect()
        if chief:   # what is measured so far, should a later model end the run
            os.makedirs(FLAGS.out, exist_ok=True)
            with open(os.path.join(FLAGS.out, "table2.partial.json"), "w") as f:
                json.dump({"command": " ".join(sys.argv), "cluster": FLAGS.cluster,
                           "batch_size": FLAGS.batch_size, "calibrations": calibrations,
                           "kernel_times": kernel_times,
                           "communication_calibrations": comm_calibrations, "runs": runs},
                          f, indent=1)
    if not chief:   # worker 0 measured the same steps and writes the results
        return
    os.makedirs(FLAGS.out, exist_ok=True)
    timed = [r for r in runs if "error" not in r]
    scales = {row: plot(timed, row, os.path.join(FLAGS.out, f"table2_scatter_{_slug(row)}.png"))
              for row in ROWS}
    table = rank_table(ranks, regrets, taus, strict)
    parts_summary = decomposition(timed, FLAGS.tie_tol)
    if parts_summary is not None:
        plot_decomposition(timed, os.path.join(FLAGS.out, "table2_decomposition.png"))
    bound = ceiling(timed, FLAGS.ceiling, FLAGS.tie_tol) if FLAGS.ceiling else None
    twins = {r["model"]: r["twin"]["paired_s"] / r["paired_s"] - 1 for r in timed
             if "twin" in r}
    if twins:
        gaps = sorted(abs(g) for g in twins.values())
        print(f"one plan built twice, per model: median gap {statistics.median(gaps):.1%}, "
              f"largest {gaps[-1]:.1%} ({len(gaps)} models)")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
           "cluster": FLAGS.cluster, "devices": n,
           "workers": workers, "top_k": FLAGS.top_k, "steps": FLAGS.steps,
           "batch_size": FLAGS.batch_size, "paired": FLAGS.paired,
           "interleave": FLAGS.interleave, "rounds": FLAGS.rounds,
           "drop_after": FLAGS.drop_after, "drop_ratio": FLAGS.drop_ratio,
           "refine_after": FLAGS.refine_after, "refine_ratio": FLAGS.refine_ratio,
           "repeats": FLAGS.repeats, "tie_tol": FLAGS.tie_tol, "rows": ROWS, "paper": PAPER,
           "table": table, "scatter_scale": scales, "decomposition": parts_summary,
           "ceiling": bound, "twins": twins, "calibrations": calibrations,
           "kernel_times": kernel_times,
           "communication_calibrations": comm_calibrations,
           "runs": runs}
    path = os.path.join(FLAGS.out, "table2.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nwritten to {path}")


def launch_workers() -> None:
    """``--workers=K``: this command in K processes on 127.0.0.1 (module docstring); worker
    0's output is printed."""
    from tapas.execution.runtime import launch
    k = FLAGS.workers
    if k < 2:
        raise app.UsageError(f"--workers={k}: a cluster of processes needs at least 2")
    if FLAGS.batch_size % k:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} is not divisible by "
                             f"--workers={k}")
    argv = [sys.executable, os.path.abspath(__file__), "--workers=0", f"--devices={k}",
            f"--models={','.join(FLAGS.models)}", f"--top_k={FLAGS.top_k}",
            f"--steps={FLAGS.steps}", f"--repeats={FLAGS.repeats}",
            f"--batch_size={FLAGS.batch_size}", f"--tie_tol={FLAGS.tie_tol}",
            f"--paired={str(FLAGS.paired).lower()}",
            f"--interleave={str(FLAGS.interleave).lower()}", f"--rounds={FLAGS.rounds}",
            f"--drop_after={FLAGS.drop_after}", f"--refine_after={FLAGS.refine_after}",
            f"--twin={str(FLAGS.twin).lower()}",
            f"--cluster={os.path.abspath(FLAGS.cluster)}", f"--out={os.path.abspath(FLAGS.out)}"]
    print(f"launching {k} workers on 127.0.0.1 (MultiWorkerMirroredStrategy)", flush=True)
    try:
        results = launch.launch(lambda i: argv, k, timeout_s=6 * 3600.0)
    except launch.LaunchError as e:
        print(f"table2: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(results[0].output, end="")


if __name__ == "__main__":
    app.run(main)
