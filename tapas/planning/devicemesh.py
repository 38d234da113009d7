"""The device mesh: ``rows`` x ``cols`` devices of a cluster, with named axes that carry
their own links. Cost, search, mesh search, export and runtime take this one type.

In:  a shape ``rows`` x ``cols`` (``"RxC"``, ``"RxC:experts"``) and, to price anything on
     it, a ``tapas.planning.cluster.Cluster`` of rows * cols devices (``Cluster.mesh(rows,
     cols)`` or ``Mesh.on(cluster)``).
Out: a frozen :class:`Mesh`: its ``data`` axis (``DATA``: the rows, data parallel, or the
     experts with ``experts``) and ``model`` axis (``MODEL``: the devices of one row, where
     the searched strategy runs), each a ``MeshAxis`` with its size, the nodes a group along
     it spans and the link its ring pays (alpha, beta); :meth:`Mesh.row_cluster`, the
     cluster one row sees (what the search of a row runs on).
Raises: ValueError when a shape is not positive, when the cluster has another number of
     devices, or when a row would straddle nodes (the message says which shape fits).

Device r = i * cols + j sits in row i, column j, and devices fill a node before the next:
a row of cols <= n devices stays inside a node (its model axis pays the intra-node link),
and a column spans the nodes its devices lie on (its data axis pays the inter-node link
when they are more than one). ``1 x N`` is the 1-D mesh (``Cluster.mesh()``): its model
axis is the whole cluster, its data axis one device. Equality and order are the shape's.

>>> from tapas.planning.cluster import Cluster
>>> m = Cluster.v100_ethernet(2, 4).mesh(2, 4)
>>> [(a.name, a.size, a.nodes, a.link.name) for a in (m.axis(DATA), m.axis(MODEL))]
[('data', 2, 2, 'ethernet-100g'), ('model', 4, 1, 'nvlink2')]
"""

from __future__ import annotations

import dataclasses

from tapas.planning.cluster import Cluster, MeshAxis

__all__ = ["Mesh", "MeshAxis", "DATA", "MODEL", "AXES"]

DATA = "data"     # over the rows: data parallelism (the experts, on a nested-experts mesh)
MODEL = "model"   # in a row: the searched (tensor-parallel) strategy
AXES = (DATA, MODEL)


@dataclasses.dataclass(frozen=True, order=True)
class Mesh:
    """``rows`` x ``cols`` devices: data parallel over the rows, tensor parallel in a row;
    with ``experts`` (written ``RxC:experts``) also the experts of every MoE layer split
    over the rows, each expert tensor parallel in its row (``tapas.planning.experts``).
    ``cluster``: the devices it lies on (None: a shape only, which prices nothing)."""

    rows: int
    cols: int
    experts: bool = False
    cluster: Cluster | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for field in ("rows", "cols"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh {field}={v!r}: must be a positive int")
        if self.experts and self.rows < 2:
            raise ValueError(f"mesh {self.rows}x{self.cols}:experts splits the experts over "
                             "the rows: it needs at least 2 rows")
        if self.cluster is not None:
            self._check_fits(self.cluster)

    def _check_fits(self, cluster: Cluster) -> None:
        n = cluster.devices_per_node
        if self.num_devices != cluster.num_devices:
            raise ValueError(f"a {self} mesh has {self.num_devices} devices, the cluster "
                             f"{cluster.name!r} {cluster.num_devices}: choose rows x cols = "
                             f"{cluster.num_devices}")
        if self.cols <= n and n % self.cols:
            raise ValueError(f"a row of {self.cols} devices would straddle nodes of {n} "
                             f"devices: use a row size that divides {n} or a multiple of it")
        if self.cols > n and self.cols % n:
            raise ValueError(f"a row of {self.cols} devices is not a whole number of nodes "
                             f"of {n} devices: use a row size that divides {n} or a multiple "
                             "of it")

    def on(self, cluster: Cluster) -> Mesh:
        """This shape on ``cluster`` (ValueError when it does not fit: module docstring)."""
        return dataclasses.replace(self, cluster=cluster)

    @property
    def num_devices(self) -> int:
        return self.rows * self.cols

    def position(self, device: int) -> tuple[int, int]:
        """(row, column) of device index ``device``."""
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} is not in a {self} mesh (0..{self.num_devices - 1})")
        return divmod(device, self.cols)

    def _bound(self, what: str) -> Cluster:
        if self.cluster is None:
            raise ValueError(f"the {self} mesh has no cluster, so {what} has no link: make it "
                             "with cluster.mesh(rows, cols) or mesh.on(cluster)")
        return self.cluster

    def axis(self, name: str) -> MeshAxis:
        """The ``DATA`` axis (a column: ``rows`` devices, on the nodes they lie on) or the
        ``MODEL`` axis (a row: ``cols`` devices, filling a node first)."""
        cluster = self._bound(f"its {name!r} axis")
        if name == MODEL:
            return cluster.axis(self.cols, name=MODEL)
        if name == DATA:
            n = cluster.devices_per_node
            nodes = len({(i * self.cols) // n for i in range(self.rows)})
            return cluster.axis(self.rows, nodes, name=DATA)
        raise ValueError(f"mesh axis {name!r} is unknown: use {DATA!r} (the rows) or "
                         f"{MODEL!r} (the devices of a row)")

    @property
    def row_cluster(self) -> Cluster:
        """The cluster one row sees: ``cols`` devices inside one node, or whole nodes (what
        the row's strategy is searched on; its model axis is this mesh's)."""
        cluster = self._bound("a row")
        n = cluster.devices_per_node
        if self.cols <= n:
            return cluster.with_shape(1, self.cols)
        return cluster.with_shape(self.cols // n, n)

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}" + (":experts" if self.experts else "")

    @property
    def plan(self) -> str:
        """What runs on it, for tables: "DP x TP" or "EP x TP" (nested experts)."""
        if self.rows == 1:
            return "TP"
        return "EP x TP" if self.experts else ("DP" if self.cols == 1 else "DP x TP")

    @staticmethod
    def parse(text: str) -> Mesh:
        """``"2x4"`` -> Mesh(2, 4); ``"2x4:experts"`` -> Mesh(2, 4, experts=True)."""
        shape, _, suffix = str(text).lower().partition(":")
        parts = shape.split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"mesh {text!r}: write it ROWSxCOLS, e.g. 2x4 (or 2x4:experts "
                             "for nested expert + tensor parallelism)")
        if suffix not in ("", "experts"):
            raise ValueError(f"mesh {text!r}: the only suffix is ':experts' (nested expert + "
                             "tensor parallelism)")
        return Mesh(int(parts[0]), int(parts[1]), suffix == "experts")
