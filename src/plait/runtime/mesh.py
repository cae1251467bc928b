"""The device mesh: named parallel axes mapped onto process groups.

Rank order is ``pp`` (outermost), ``dp``, ``fsdp``, ``cp``, ``tp`` (innermost)::

    rank = (((pp_i * dp + dp_i) * fsdp + fsdp_i) * cp + cp_i) * tp + tp_i

Tensor parallelism sits innermost because it talks on every layer, so its ranks should be
neighbours on one machine (consecutive local ranks share a node under torchrun). Context
parallelism (``cp``: the sequence split across ranks) passes key/value blocks around a ring in
every attention layer, the next heaviest traffic, so it sits next to tp. Pipeline
parallelism only sends activations between neighbouring stages, so it tolerates the slowest
links and sits outermost.

Process groups are created at construction, by every rank, in one fixed order: creating
groups lazily would require all ranks to ask for the same group at the same moment, which is
an easy way to deadlock. Only the axis combinations the library asks for are made (`KINDS`, plus
any named in ``groups=``), one group per distinct set of ranks: every subset of five axes would
be 31 kinds, most of them never used, and at a thousand ranks each kind costs every rank one
``new_group`` call per group of that kind. A combination whose other axes all have size 1 is
this rank alone; that group is made on first use, by this rank only (nothing to agree on).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch.distributed as dist

from plait.runtime import comm

AXES: tuple[str, ...] = ("pp", "dp", "fsdp", "cp", "tp")
# Groups folded out of the data axes for expert parallelism (not axes of their own: the ranks of
# one ep group are data-parallel ranks that hold different experts).
FOLDED: tuple[str, ...] = ("ep", "edp")
# The axis combinations plait's strategies ask for; `Mesh(groups=...)` adds others.
KINDS: tuple[tuple[str, ...], ...] = (
    ("pp",), ("dp",), ("fsdp",), ("cp",), ("tp",),
    ("dp", "cp"),          # DDP's default: cp ranks hold the same weights as dp ranks
    ("fsdp", "cp"),        # FSDP's shards
    ("dp", "fsdp"),        # the ranks that see different data (plait check, plait train)
    ("dp", "fsdp", "cp"),  # the loss average; the expert-data group when ep = 1
)


class Mesh:
    """Named axes ``pp``, ``dp``, ``fsdp``, ``cp``, ``tp`` over the default process group.

    One degree may be ``-1``, meaning "whatever is left of the world size". Build it once
    (after `plait.init()`) and pass it explicitly to each strategy. The degrees are keywords,
    listed in rank order (``tp`` varies fastest: its ranks are neighbours, on one node).

    ``groups`` names further axis combinations to make groups for, beyond `KINDS` (for a
    script's own collectives, e.g. ``groups=[("pp", "tp")]``); every rank must pass the same.
    `destroy` releases the groups when the mesh is done with.
    """

    def __init__(self, *, pp: int = 1, dp: int = 1, fsdp: int = 1, cp: int = 1, tp: int = 1,
                 ep: int = 1, groups: Sequence[Sequence[str]] = ()) -> None:
        if not dist.is_initialized():
            raise RuntimeError("plait.Mesh needs a process group: call plait.init() first")
        world = dist.get_world_size()
        degrees = {"pp": pp, "dp": dp, "fsdp": fsdp, "cp": cp, "tp": tp}
        self.shape: dict[str, int] = _resolve_degrees(degrees, world)
        self.world_size = world
        self.global_rank = dist.get_rank()
        self.coords: dict[str, int] = self._coords_of(self.global_rank)
        data = self.shape["dp"] * self.shape["fsdp"]
        if not isinstance(ep, int) or ep < 1 or data % ep:
            raise ValueError(f"Mesh(ep={ep}): expert parallelism folds its groups out of the data axes, "
                             f"dp x fsdp = {data} ranks here; ep must be a positive integer dividing {data}")
        self.ep = ep
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._group_ranks: dict[tuple[str, ...], list[int]] = {}
        self._made: list[dist.ProcessGroup] = []
        self._build_groups([*KINDS, *(self._axes(g) for g in groups)])
        self._build_expert_groups()

    # ----------------------------------------------------------------- queries
    def size(self, axes: str | Sequence[str]) -> int:
        """Number of ranks along one axis or the product over several (or in a `FOLDED` group)."""
        axes = self._unfold(axes)
        if axes in FOLDED:
            return len(self._group_ranks[(str(axes), "folded")])
        return math.prod(self.shape[a] for a in self._axes(axes))

    def rank(self, axes: str | Sequence[str]) -> int:
        """This rank's index along one axis (or flattened over several, row-major; or in a
        `FOLDED` group)."""
        axes = self._unfold(axes)
        if axes in FOLDED:
            return self._group_ranks[(str(axes), "folded")].index(self.global_rank)
        idx = 0
        for a in self._axes(axes):
            idx = idx * self.shape[a] + self.coords[a]
        return idx

    def group(self, axes: str | Sequence[str]) -> dist.ProcessGroup:
        """The process group of ranks that differ from this one only along ``axes``; or ``"ep"``:
        the data ranks that share tokens among their experts (``ep`` consecutive data ranks), and
        ``"edp"``: the ranks holding the same experts (the other data ranks, and cp ranks)."""
        axes = self._unfold(axes)
        if axes in FOLDED:
            return self._groups[(str(axes), "folded")]
        key = self._key(axes)
        if key not in self._groups:
            if key:
                made = sorted({"x".join(k) for k in self._groups if k and k[-1] != "folded"})
                raise ValueError(f"{self}: no group for axes {tuple(self._axes(axes))}; groups are made at "
                                 f"construction, by every rank together, for {made} (axes of size 1 left "
                                 f"out): pass Mesh(..., groups=[{tuple(self._axes(axes))!r}]) to make it")
            self._add(key, [self.global_rank], comm.new_local_group(self.global_rank, "self"))
        return self._groups[key]

    def group_ranks(self, axes: str | Sequence[str]) -> list[int]:
        """Global ranks of `group(axes)`, ordered by their index along ``axes``."""
        axes = self._unfold(axes)
        if axes in FOLDED:
            return list(self._group_ranks[(str(axes), "folded")])
        key = self._key(axes)
        return list(self._group_ranks[key]) if key else [self.global_rank]

    def all_group_ranks(self, axis: str) -> list[list[int]]:
        """For every coordinate of the other axes, the global ranks along ``axis`` (by index).

        The same list, in the same order, on every rank: for creating per-coordinate process
        groups, which every rank of the world must create together.
        """
        others = [a for a in AXES if a != axis]
        lines = []
        for combo in itertools.product(*(range(self.shape[a]) for a in others)):
            fixed = dict(zip(others, combo))
            lines.append([self.global_rank_of(**fixed, **{axis: i}) for i in range(self.shape[axis])])
        return lines

    def global_rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; unspecified axes keep this rank's coordinate."""
        full = {**self.coords, **coords}
        r = 0
        for a in AXES:
            if not 0 <= full[a] < self.shape[a]:
                raise ValueError(f"coordinate {a}={full[a]} outside 0..{self.shape[a] - 1}")
            r = r * self.shape[a] + full[a]
        return r

    def __repr__(self) -> str:
        degrees = ", ".join(f"{a}={self.shape[a]}" for a in AXES)
        degrees += f", ep={self.ep}" if self.ep > 1 else ""
        return f"Mesh({degrees}; rank {self.global_rank} at {self.coords})"

    # --------------------------------------------------------------- internals
    def _unfold(self, axes: str | Sequence[str]) -> str | Sequence[str]:
        """At ep = 1 the folded groups are mesh groups: ``ep`` this rank alone, ``edp`` every data
        and cp rank."""
        if self.ep == 1 and axes in FOLDED:
            return () if axes == "ep" else ("dp", "fsdp", "cp")
        return axes

    def _axes(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in names:
            if a not in AXES:
                raise ValueError(f"unknown mesh axis {a!r}; the axes are {AXES}")
        return tuple(a for a in AXES if a in names)  # canonical order

    def _key(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        # Axes of size 1 do not change group membership, so they share one group.
        return tuple(a for a in self._axes(axes) if self.shape[a] > 1)

    def _coords_of(self, rank: int) -> dict[str, int]:
        coords = {}
        for a in reversed(AXES):
            coords[a] = rank % self.shape[a]
            rank //= self.shape[a]
        return {a: coords[a] for a in AXES}

    def _build_groups(self, kinds: Sequence[tuple[str, ...]]) -> None:
        all_coords = [self._coords_of(r) for r in range(self.world_size)]
        for kind in kinds:
            key = tuple(a for a in kind if self.shape[a] > 1)
            if not key or key in self._groups:  # this rank alone (made on first use), or made already
                continue
            # Ranks that agree on every axis outside `key` form one group.
            buckets: dict[tuple[int, ...], list[int]] = {}
            for r, c in enumerate(all_coords):
                fixed = tuple(c[a] for a in AXES if a not in key)
                buckets.setdefault(fixed, []).append(r)
            for ranks in buckets.values():
                # A new group even when it spans the world: sharing WORLD would let the next
                # Mesh relabel it, and its traffic would be booked under the wrong axis.
                pg = comm.new_group(ranks, "x".join(key))
                if pg is not None:
                    self._add(key, ranks, pg)

    def _add(self, key: tuple[str, ...], ranks: list[int], pg: dist.ProcessGroup) -> None:
        self._groups[key] = pg
        self._group_ranks[key] = ranks
        self._made.append(pg)

    def own_groups(self) -> list[dist.ProcessGroup]:
        """The process groups this mesh made on this rank, oldest first (companions not included)."""
        return list(self._made)

    def destroy(self) -> None:
        """Release this mesh's process groups (and their desync-check companions).

        Call it on every rank once no collective on the mesh's groups is in flight (after the
        last step; `torch.distributed.barrier` first if ranks may still be finishing one). The
        mesh, and every wrapper built on it, cannot communicate afterwards.
        """
        for pg in reversed(self._made):
            comm.destroy_group(pg)
        self._made.clear()
        self._groups.clear()
        self._group_ranks.clear()

    def _build_expert_groups(self) -> None:
        """The ``ep`` and ``edp`` groups: data index ``d = dp_i * fsdp + fsdp_i`` splits into
        ``d // ep`` (which ep group) and ``d % ep`` (the rank within it, which experts it holds)."""
        if self.ep == 1:  # every rank holds every expert: see `_unfold`
            return
        lines: dict[tuple[str, tuple[int, ...]], list[tuple[tuple[int, ...], int]]] = {}
        for r in range(self.world_size):
            c = self._coords_of(r)
            d = c["dp"] * self.shape["fsdp"] + c["fsdp"]
            ep_key, edp_key = (c["pp"], c["cp"], c["tp"], d // self.ep), (c["pp"], c["tp"], d % self.ep)
            lines.setdefault(("ep", ep_key), []).append(((d % self.ep,), r))
            lines.setdefault(("edp", edp_key), []).append(((d // self.ep, c["cp"]), r))
        for (name, _), members in sorted(lines.items()):  # the same order on every rank
            ranks = [r for _, r in sorted(members)]
            pg = comm.new_group(ranks, name)
            if pg is not None:
                self._add((name, "folded"), ranks, pg)


def _resolve_degrees(degrees: dict[str, int], world: int) -> dict[str, int]:
    described = ", ".join(f"{a}={d}" for a, d in degrees.items())
    wild = [a for a, d in degrees.items() if d == -1]
    bad = [a for a, d in degrees.items() if not isinstance(d, int) or (d < 1 and d != -1)]
    if bad:
        raise ValueError(
            f"Mesh degrees must be positive integers (or one -1); got {described} "
            f"(invalid: {', '.join(bad)}) for world size {world}"
        )
    if len(wild) > 1:
        raise ValueError(f"at most one Mesh degree may be -1; got {described} for world size {world}")
    known = math.prod(d for d in degrees.values() if d != -1)
    if wild:
        if world % known:
            raise ValueError(
                f"Mesh({described}): world size {world} is not divisible by the product of the "
                f"other degrees ({known}), so {wild[0]}=-1 cannot be resolved"
            )
        degrees = {**degrees, wild[0]: world // known}
    product = math.prod(degrees.values())
    if product != world:
        raise ValueError(
            f"Mesh({described}): the product of the degrees is {product} but the world size is "
            f"{world}; pp*dp*fsdp*cp*tp must equal the number of processes"
        )
    return degrees
