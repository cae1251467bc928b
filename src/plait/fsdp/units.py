"""Sharding units for plait's FSDP: which parameters go together, and materializing shards.

A *unit* is a module whose parameters are gathered and freed together (by default each
repeated block, `plait.state.blocks`: every child of an ``nn.ModuleList``, or of an ``nn.ModuleDict`` or
``nn.Sequential`` of blocks of one class, plus the root, which owns whatever no block owns). A
parameter tied across units (its owners sit in different units) belongs to their deepest common
ancestor unit, which is gathered whenever any of them runs.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.fsdp.flat import FlatParam, ShardCfg, Slot
from plait.runtime.env import get_logger
from plait.state.blocks import DESCRIBED, blocks
from plait.state.materialize import Keep, materialize
from plait.state.names import matches
from plait.state.placement.pieces import carry_mark
from plait.state.placement.records import expert_of, grad_hooks_of
from plait.state.precision import MixedPrecision, parse_mixed_precision

Policies = MixedPrecision | str | None | Mapping[str, MixedPrecision | str | None]


@dataclass(eq=False)  # units compare by identity (they list each other for prefetching)
class Unit:
    name: str  # qualified module name; "" for the root
    module: nn.Module
    flats: list[FlatParam] = field(default_factory=list)
    position: int = -1  # index in the current forward's execution order
    mp: MixedPrecision | None = None  # its mixed-precision policy (torch: one per fully_shard call)
    # torch's per-FSDPModule controls (`plait.fsdp.controls`); None: the wrapper's default.
    sync: bool = True  # reduce gradients in backward (False: accumulate, as under no_sync)
    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = True
    forward_prefetch: list[Unit] | None = None  # gathered at this unit's pre-forward
    backward_prefetch: list[Unit] | None = None  # gathered at this unit's pre-backward

    def prefetch(self) -> None:
        for f in self.flats:
            f.start_gather()

    def gather(self) -> None:
        self.prefetch()
        for f in self.flats:
            f.finish_gather()

    def reshard(self) -> None:
        for f in self.flats:
            f.reshard()


def check_no_optimizer(module: nn.Module) -> None:
    """Raise if an optimizer already holds ``module``'s parameters (it would update dead copies)."""
    params = tuple(module.parameters())  # not a list: one an optimizer's groups would hold

    def offenders() -> list[torch.optim.Optimizer]:
        return _optimizers_holding(params) if params else []

    if offenders() and (gc.collect() or True) and (found := offenders()):
        raise ValueError(
            f"FullyShardedDataParallel(module=...): an optimizer ({type(found[0]).__name__}) was built "
            "on this module's parameters before wrapping; after wrapping those tensors are replaced by "
            "this rank's shards and the optimizer would update nothing. Build the optimizer on the "
            "wrapped model's .parameters() after FullyShardedDataParallel(...)")


def _optimizers_holding(params: tuple[nn.Parameter, ...]) -> list[torch.optim.Optimizer]:
    """The optimizers that list any of ``params``, found by following references back from them
    (an optimizer holds them in ``param_groups[i]["params"]`` lists, in dicts, in its
    ``param_groups`` list): one scan of the collector's objects per step back, in C. Testing the
    type of every live object in Python instead cost about 0.2 s per wrap in a process that had
    imported a large library."""
    held = [r for r in _referrers(params) if isinstance(r, list)]
    groups = [g for g in _referrers(held) if isinstance(g, dict) and any(g.get("params") is h for h in held)]
    lists = [r for r in _referrers(groups) if isinstance(r, list)]
    owners = _referrers(lists)  # the optimizer, or its __dict__
    owners += _referrers([o for o in owners if isinstance(o, dict)])
    found = {id(o): o for o in owners
             if isinstance(o, torch.optim.Optimizer) and any(o.param_groups is g for g in lists)}
    return list(found.values())


def _referrers(objects: Sequence[object]) -> list[object]:
    return gc.get_referrers(*objects) if objects else []


def unit_policies(module: nn.Module, spec: Sequence[type | str] | None,
                  mixed_precision: Policies) -> dict[str, MixedPrecision | None]:
    """Each unit's mixed-precision policy, by unit name (the root's is ""). One policy (or a
    string) applies to every unit; a mapping from module-name patterns to policies gives each unit
    the policy of the first pattern naming it (the key "" names the root), and a unit no pattern
    names takes its closest enclosing unit's, as torch's ``fully_shard`` applied to a submodule
    with a ``mp_policy`` of its own. A pattern that names no unit is refused."""
    where = "FullyShardedDataParallel(mixed_precision=...)"
    names = _unit_names(module, spec, warn=False)
    if not isinstance(mixed_precision, Mapping):
        one = parse_mixed_precision(mixed_precision, where)
        return dict.fromkeys(names, one)
    parsed = {k: parse_mixed_precision(v, f"{where}[{k!r}]") for k, v in mixed_precision.items()}
    for key in parsed:
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys are module-name patterns, got {key!r}")
        if not any(key == n or (key and matches(key, n)) for n in names):
            raise ValueError(f"{where}: {key!r} names no sharding unit (units: {names}); a policy belongs "
                             "to a unit, so add the module to units=[...] as well (\"\" names the root)")
    out: dict[str, MixedPrecision | None] = {}
    for n in sorted(names, key=lambda n: -1 if n == "" else n.count(".")):  # enclosing units first
        named = next((k for k in parsed if k == n or (k and matches(k, n))), None)
        if named is not None:
            out[n] = parsed[named]
        else:
            outer = max((u for u in out if _contains(u, n) and u != n), key=len, default=None)
            out[n] = out[outer] if outer is not None else None
    return out


def _unit_names(module: nn.Module, spec: Sequence[type | str] | None, warn: bool = True) -> list[str]:
    names = [""]
    if spec is None:
        names += blocks(module)
        if warn and len(names) == 1 and any(True for _ in module.children()):
            get_logger().warning(
                "FullyShardedDataParallel: %s holds no %s, so the whole model is one sharding unit, "
                "gathered whole for every forward and backward; name the units with units=[...] (module "
                "classes or name patterns)", type(module).__name__, DESCRIBED)
        return names
    for s in spec:
        if not isinstance(s, (str, type)):
            raise TypeError(f"FullyShardedDataParallel(units=...) entries must be module classes or "
                            f"name patterns, got {s!r}")
    used: set[int] = set()
    for name, mod in module.named_modules():
        if not name:
            continue  # the root is always a unit
        for i, s in enumerate(spec):
            if (isinstance(s, type) and isinstance(mod, s)) or (isinstance(s, str) and matches(s, name)):
                names.append(name)
                used.add(i)
                break
    unused = [spec[i] for i in range(len(spec)) if i not in used]
    if unused:
        raise ValueError(f"FullyShardedDataParallel(units=...): {unused} matched no submodule of "
                         f"{type(module).__name__}")
    return names


def _contains(unit: str, mod_name: str) -> bool:
    return unit == "" or mod_name == unit or mod_name.startswith(unit + ".")


def build_units(module: nn.Module, spec: Sequence[type | str] | None, cfg: ShardCfg, seed: int,
                ignored: frozenset[int] = frozenset(),
                policies: Mapping[str, MixedPrecision | None] | None = None) -> list[Unit]:
    """Group ``module``'s parameters into units, shard them, materialize this rank's slices.

    ``policies`` (`unit_policies`) gives each unit its compute and reduction dtypes; without it
    every unit takes ``cfg``'s.

    Parameters whose ids are in ``ignored`` (torch's ``ignored_params``) stay whole, plain and
    unsynchronised, as FSDP2 leaves them. Afterwards the other parameters are gone from the modules
    (`FlatParam.bind_views` puts the DTensor parameters and the gathered leaves in their place)
    and buffers sit on the compute device.
    """
    names = _unit_names(module, spec)
    by_depth = sorted(names, key=lambda n: -1 if n == "" else n.count("."), reverse=True)
    modules = dict(module.named_modules())

    def unit_of(mod_name: str) -> str:
        return next(u for u in by_depth if _contains(u, mod_name))

    # Every parameter, its owners (several when tied) and the units those owners sit in.
    info: dict[int, tuple[nn.Parameter, Slot, list[str]]] = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None or expert_of(p) is not None or id(p) in ignored:  # experts, ignored: whole
                continue
            fqn = f"{mname}.{attr}" if mname else attr
            if id(p) not in info:
                hooks = grad_hooks_of(p)  # re-registered on the alias leaf
                info[id(p)] = (p, Slot(fqn, p.shape, grad_hooks=hooks), [])
            else:
                info[id(p)][1].aliases.append(fqn)
            info[id(p)][1].owners.append((mod, attr))
            info[id(p)][2].append(unit_of(mname))

    groups: dict[tuple[str, torch.dtype, bool], list[Slot]] = {}
    for p, slot, owner_units in info.values():
        home = next(u for u in by_depth if all(_contains(u, o) for o in owner_units))
        groups.setdefault((home, p.dtype, p.requires_grad), []).append(slot)
    units = {n: Unit(n, modules[n]) for n in names}
    cfgs = {n: cfg for n in names}
    if policies is not None:
        for n in names:
            mp = units[n].mp = policies.get(n)
            cfgs[n] = dataclasses.replace(cfg, param_dtype=mp.param_dtype if mp else None,
                                          reduce_dtype=mp.reduce_dtype if mp else None)
    where: dict[int, tuple[FlatParam, int]] = {}
    for (home, dtype, req), slots in groups.items():
        flat = FlatParam(slots, dtype, req, cfgs[home])
        flat.label = f"unit {home or '(root)'!r} ({dtype}{'' if req else ', frozen'})"
        units[home].flats.append(flat)
        for i, s in enumerate(slots):
            where[id(s.owners[0][0]._parameters[s.owners[0][1]])] = (flat, i)

    materialize(module, seed, _keep_shard(where, cfg, ignored))
    # Units left without parameters (all of theirs tied elsewhere) need no hooks.
    return [units[n] for n in names if units[n].flats or n == ""]


def _keep_shard(where: dict[int, tuple[FlatParam, int]], cfg: ShardCfg, ignored: frozenset[int]) -> Keep:
    """FSDP's share of each tensor: a parameter's rows go into its flat shard (the module's own
    parameter is replaced by the DTensor afterwards), a buffer stays whole on the compute device."""

    def keep(name: str, attr: str, full: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(t, nn.Parameter):
            return full.to(cfg.device)
        placed = expert_of(t)
        if id(t) in ignored:  # whole, on the device, left alone
            if not t.is_meta and t.device == cfg.device:
                return t
            return nn.Parameter(full.to(cfg.device), requires_grad=t.requires_grad)
        if placed is not None:  # an expert: whole, on the device, still marked
            if not t.is_meta and t.device == cfg.device:
                return t
            kept = nn.Parameter(full.to(cfg.device), requires_grad=t.requires_grad)
            carry_mark(t, kept)  # its expert placement, and split over ep: torch's clip must still refuse it
            return kept
        flat, i = where[id(t)]
        slot = flat.slots[i]
        a, b = slot.rows_of(cfg.rank)
        with torch.no_grad():
            flat.local(i).copy_(full if slot.replicated else full[a:b])
        return None  # the DTensor parameter replaces it (`FlatParam.bind_views`)

    return keep
