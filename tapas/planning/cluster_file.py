"""The cluster file: ``Cluster`` <-> its versioned JSON object, the package's one codec.

In:  a ``tapas.planning.cluster.Cluster``, or a JSON object / file written by :func:`save`
     (``tapas profile --out=...``; a strategy file embeds the same object, and older
     strategy files an older layout, ``older_layout=True``).
Out: :func:`to_json` (``format``, ``version`` and every field), :func:`save` /
     :func:`load` (the file), :func:`from_json` (every field read and checked).
Raises: ``ClusterFileError`` naming the file (``where``) and the field, with the fix.

``Cluster.to_json``, ``from_json``, ``save`` and ``load`` call these.
This module imports no TensorFlow.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from tapas.planning.cluster import (ALL_SOURCE_KEYS, CLUSTER_FORMAT, CLUSTER_VERSION, Cluster,
                                    ClusterFileError, Link)
from tapas.planning.hardware import peaks_by_dtype
from tapas.planning.widths import check_width_efficiency as _width_efficiency
from tapas.sharding.placements import Collective

__all__ = ["to_json", "from_json", "save", "load"]


def to_json(cluster: Cluster) -> dict[str, Any]:
    """``cluster`` as the JSON object ``save`` writes (``format``, ``version``, fields)."""
    return {"format": CLUSTER_FORMAT, "version": CLUSTER_VERSION, "name": cluster.name,
            "num_nodes": cluster.num_nodes, "devices_per_node": cluster.devices_per_node,
            "intra": _link_json(cluster.intra), "inter": _link_json(cluster.inter),
            "device_memory": cluster.device_memory,
            "device_peak_flops": cluster.device_peak_flops,
            "epsilon": None if cluster.epsilon is None else dict(cluster.epsilon),
            "gamma": cluster.gamma, "device_elementwise_rate": cluster.device_elementwise_rate,
            "device_width_efficiency": None if cluster.device_width_efficiency is None else
            {str(k): v for k, v in cluster.device_width_efficiency.items()},
            "device_peak_flops_by_dtype": None if cluster.device_peak_flops_by_dtype is None
            else dict(cluster.device_peak_flops_by_dtype),
            "sources": dict(cluster.sources)}


def save(cluster: Cluster, path: str, extra: Mapping[str, Any] | None = None) -> None:
    """Write the cluster to ``path`` as JSON (``to_json``); ``extra`` adds keys that
    ``load`` skips (``tapas profile`` stores its measurements under ``"profile"``)."""
    d = to_json(cluster)
    for key in extra or {}:
        if key in d:
            raise ValueError(f"extra key {key!r} would overwrite the cluster field {key!r}; "
                             "put extra data under another key, e.g. 'profile'")
    d.update(extra or {})
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(d, f, indent=1)
        f.write("\n")


def load(path: str) -> Cluster:
    """Read a cluster file written by ``save`` (or ``tapas profile``)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ClusterFileError(f"cluster file {path!r} cannot be read ({e.strerror}); give "
                               "the path of a file written by `tapas profile --out=...` "
                               "or Cluster.save") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterFileError(f"cluster file {path!r} is not JSON ({e}); write it with "
                               "`tapas profile --out=...` or Cluster.save") from None
    return from_json(d, f"cluster file {path!r}")


def _link_json(link: Link) -> dict[str, Any]:
    return {"name": link.name, "bandwidth": link.bandwidth, "latency": link.latency}


class _Fields:
    """The fields of a cluster file, each read and checked; errors name the file and field."""

    def __init__(self, d: Mapping[str, Any], where: str) -> None:
        self.d, self.where = d, where

    def fail(self, field: str, problem: str) -> ClusterFileError:
        return ClusterFileError(f"{self.where}: field {field!r} {problem}; re-create the file "
                                "with `tapas profile --out=...` or Cluster.save, or fix that "
                                "field")

    def get(self, field: str, kind: tuple[type, ...], what: str,
            obj: Mapping[str, Any] | None = None, prefix: str = "") -> Any:
        obj = self.d if obj is None else obj
        name = prefix + field
        if field not in obj:
            raise self.fail(name, f"is missing (it must be {what})")
        value = obj[field]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(name, f"is {value!r}, it must be {what}")
        return value

    def number(self, field: str, what: str, obj: Mapping[str, Any] | None = None,
               prefix: str = "", zero_ok: bool = False) -> float:
        value = float(self.get(field, (int, float), what, obj, prefix))
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise self.fail(prefix + field, f"is {value!r}, it must be {what}")
        return value

    def link(self, field: str) -> Link:
        obj = self.get(field, (dict,), "an object {name, bandwidth, latency}")
        return Link(bandwidth=self.number("bandwidth", "a positive number of bytes/s", obj,
                                          field + "."),
                    latency=self.number("latency", "a number of seconds >= 0", obj,
                                        field + ".", zero_ok=True),
                    name=str(obj.get("name", field)))

    def sources(self) -> dict[str, str]:
        sources = self.d.get("sources", {})
        if not isinstance(sources, dict) or not all(isinstance(v, str)
                                                    for v in sources.values()):
            raise self.fail("sources", "must be an object of strings (constant -> where it "
                            "comes from)")
        allowed = ALL_SOURCE_KEYS
        for key in sources:
            if key not in allowed:
                raise self.fail(f"sources.{key}",
                                f"is not a cluster constant (use {list(allowed)})")
        return sources

    def epsilon(self) -> dict[str, Any] | None:
        epsilon = self.d.get("epsilon")
        if epsilon is not None:
            if not isinstance(epsilon, dict):
                raise self.fail("epsilon", f"is {epsilon!r}, it must be null or an object "
                                "{primitive: factor}")
            for key in epsilon:
                try:
                    Collective.parse(key)
                except ValueError as e:
                    raise self.fail(f"epsilon.{key}", str(e)) from None
                self.number(key, "a positive factor", epsilon, "epsilon.")
        return epsilon

    def optional_rates(self) -> tuple[float | None, float | None, Any]:
        """gamma, the elementwise rate and the width efficiency table (each may be null)."""
        gamma = self.d.get("gamma")
        if gamma is not None:
            gamma = self.number("gamma", "a number in (0, 1]")
            if gamma > 1:
                raise self.fail("gamma", f"is {gamma!r}, it must be a number in (0, 1]")
        rate = self.d.get("device_elementwise_rate")
        if rate is not None:
            rate = self.number("device_elementwise_rate",
                               "null or a positive number of elements/s")
        widths = self.d.get("device_width_efficiency")
        if widths is not None:
            if not isinstance(widths, dict) or not widths:
                raise self.fail("device_width_efficiency", f"is {widths!r}, it must be null "
                                "or an object {width: fraction of device_peak_flops}")
            try:
                widths = _width_efficiency(widths)
            except ValueError as e:
                raise self.fail("device_width_efficiency", str(e)) from None
        return gamma, rate, widths


def from_json(d: Any, where: str = "cluster JSON", older_layout: bool = False) -> Cluster:
    """A :func:`to_json` object's cluster, every field checked (``ClusterFileError`` names
    ``where`` and the field); ``older_layout``: also old strategy files' (:func:`_older_layout`)."""
    if older_layout and isinstance(d, dict) and "format" not in d:
        return _older_layout(d)
    if not isinstance(d, dict):
        raise ClusterFileError(f"{where}: must be a JSON object, got {type(d).__name__}; "
                               "write it with `tapas profile --out=...` or Cluster.save")
    f = _Fields(d, where)
    if d.get("format") != CLUSTER_FORMAT:
        raise f.fail("format", f"is {d.get('format')!r}, expected {CLUSTER_FORMAT!r} (not a "
                     "cluster file: a strategy or report JSON?)")
    version = d.get("version")
    if version != CLUSTER_VERSION:
        raise f.fail("version", f"is {version!r}; this TAPAS reads version {CLUSTER_VERSION}")
    name = f.get("name", (str,), "a string")
    shape = {}
    for field in ("num_nodes", "devices_per_node"):
        shape[field] = f.get(field, (int,), "an int >= 1")
        if shape[field] < 1:
            raise f.fail(field, f"is {shape[field]}, it must be an int >= 1")
    intra, inter = f.link("intra"), f.link("inter")
    memory = f.number("device_memory", "a positive number of bytes")
    flops = f.number("device_peak_flops", "a positive number of FLOP/s")
    sources, epsilon = f.sources(), f.epsilon()
    gamma, rate, widths = f.optional_rates()
    peaks = _peaks_field(d, f.fail)
    return Cluster(name=name, num_nodes=shape["num_nodes"],
                   devices_per_node=shape["devices_per_node"], intra=intra, inter=inter,
                   device_memory=memory, device_peak_flops=flops, sources=sources,
                   epsilon=epsilon, gamma=gamma, device_elementwise_rate=rate,
                   device_width_efficiency=widths, device_peak_flops_by_dtype=peaks)


def _older_layout(d: Mapping[str, Any]) -> Cluster:
    """The cluster of a strategy file written before the cluster file existed: no
    ``format``, links as ``[bandwidth, latency, name]``, profiled fields absent."""
    return Cluster(d["name"], d["num_nodes"], d["devices_per_node"], Link(*d["intra"]),
                   Link(*d["inter"]), d["device_memory"], d["device_peak_flops"],
                   d.get("sources", {}), d.get("epsilon"), d.get("gamma"),
                   d.get("device_elementwise_rate"), d.get("device_width_efficiency"))


def _peaks_field(d: Mapping[str, Any], fail: Callable[[str, str], Exception]
                 ) -> dict[str, float] | None:
    """A cluster file's ``device_peak_flops_by_dtype`` (absent from files written before it
    existed: None), checked; ``fail(field, problem)`` makes the error."""
    peaks = d.get("device_peak_flops_by_dtype")
    if peaks is None:
        return None
    try:
        return peaks_by_dtype(peaks)
    except (TypeError, ValueError) as e:
        raise fail("device_peak_flops_by_dtype", str(e)) from None
