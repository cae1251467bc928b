"""Deterministic, sharding-independent initialisation.

Each module that owns parameters or buffers directly is initialised by its own
``reset_parameters()`` under an RNG seeded from ``(seed, module name)``. The values of a
module therefore depend only on the seed and its name, never on the order modules are
visited or on how the model is split, which is what lets a rank that builds the model on the
meta device materialize exactly the slice a single-process run would hold:

    oracle = GPT(cfg); init_weights(oracle, seed=0)          # single process
    with torch.device("meta"): model = GPT(cfg)              # any strategy, any rank
    ... strategy calls full_values(...) one module at a time and keeps its shard

Only one module's full tensors exist at a time, so no rank ever holds the full model.

What ``reset_parameters()`` does not give (the module has none, or it leaves a tensor unset:
torchtitan's Llama computes its rotary table ``freqs_cis`` in the root ``__init__``) comes from the
model's own init protocol: the nearest ``init_weights()`` callable without arguments, the module's
own or an enclosing module's, run on a copy of that module's subtree in which every other tensor
is on the meta device. So it gives values to the missing tensors only, under the module's seed,
and initialises nothing else a second time (the oracle's weights are its ``reset_parameters()``
values, not ``init_weights()``'s). A buffer built on a real device that no ``reset_parameters()``
sets keeps its constructed value, which is what the single-process model holds. A tensor still
without a value is refused by name: plait never invents one (zeros, uninitialised memory).
"""

from __future__ import annotations

import copy
import inspect
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from plait.runtime.env import is_dry_run
from plait.state.names import plain_name
from plait.state.placement.pieces import carry_mark

# What a strategy keeps of one tensor: (owner's qualified name, attribute, full value, the
# current tensor) -> the tensor to put in its place, or None to leave the module untouched.
Keep = Callable[[str, str, torch.Tensor, torch.Tensor], "torch.Tensor | None"]
# id(tensor) -> (qualified name, module, attribute) of its first owner in the whole model.
Owners = dict[int, tuple[str, nn.Module, str]]
# A recorded tensor: (its id, shape, dtype, whether a parameter, requires_grad).
_Spec = tuple[int, torch.Size, torch.dtype, bool, bool]


def module_seed(seed: int, name: str) -> int:
    # The uncompiled model's name: a torch.compile'd block starts from the values it has uncompiled.
    return (seed * 1_000_003 + zlib.crc32(plain_name(name).encode())) % (2**63 - 1)


def owner_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Modules that own parameters or buffers directly (not through children)."""
    for name, mod in module.named_modules(prefix=prefix, remove_duplicate=True):
        if mod._parameters or mod._buffers:
            yield name, mod


def first_owners(module: nn.Module) -> Owners:
    """id(tensor) -> (qualified name, module, key) of the tensor's first owner in named_modules order."""
    out: Owners = {}
    for qual, mod in module.named_modules():
        for key, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None:
                out.setdefault(id(t), (qual, mod, key))
    return out


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` still waits to be materialized: it has meta tensors, outside a dry run
    (`plait.runtime.env.dry_run`, where meta tensors stand for materialized ones)."""
    return not is_dry_run() and any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def full_values(mod: nn.Module, name: str, seed: int,
                root: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The full-size initial values of ``mod``'s own parameters and buffers, on CPU.

    ``name`` is the module's qualified name in the *original* model, ``root``, whose modules on the
    way to ``mod`` may give what ``mod``'s ``reset_parameters()`` does not (their ``init_weights()``,
    see the module's docstring; without ``root``, ``mod``'s own only). Works for modules on the meta
    device: a shallow copy with placeholder CPU tensors is reset under the seeded RNG.
    """
    return _values(mod, name, seed, _Tree([("", root)] if root is not None else [(name, mod)]))


@torch.no_grad()
def init_weights(module: nn.Module, seed: int = 0) -> nn.Module:
    """Initialise every parameter and buffer of a materialized module in place, by name.

    The single-process reference for every strategy's meta-device initialisation.

    A tensor shared by several modules (tied weights) takes the values of its first owner
    in ``named_modules()`` order; every strategy follows the same rule.
    """

    def copy_in(_name: str, _attr: str, full: torch.Tensor, t: torch.Tensor) -> None:
        t.copy_(full)

    materialize(module, seed, copy_in, fresh=True)
    return module


def keep_whole(device: torch.device) -> Keep:
    """Every tensor whole on ``device`` (DDP's replicas, a pipeline stage, the oracle of a check);
    a materialized tensor already there stays the same object."""

    def keep(_name: str, _attr: str, full: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
        return None if not t.is_meta and t.device == device else full.to(device)

    return keep


@torch.no_grad()
def materialize(roots: nn.Module | Sequence[tuple[str, nn.Module]], seed: int, keep: Keep,
                origin: nn.Module | None = None, *, fresh: bool = False, shallow: bool = False) -> None:
    """Give each parameter and buffer under ``roots`` what ``keep`` makes of its full value.

    The one materializer of every strategy (FSDP keeps a slice in its flat shard, tensor
    parallelism a shard, a pipeline stage the whole tensor on its device, `init_weights` copies
    it in place). Owner modules are visited one at a time and a meta tensor's full value is
    computed for its owner only, so no rank ever holds more than one module's full tensors.
    Already materialized tensors are passed as they are (``fresh``: their initial values too). A
    tensor shared by several owners (tied weights) is seen once, with the values of its first
    owner, and every owner gets the same replacement.

    ``roots`` is a module, or (qualified name, module) pairs for parts of a larger model; the whole
    model, ``origin``, gives a tensor tied to a module outside ``roots`` its first owner's values
    (pipeline stages) and the modules above the parts their ``init_weights()``. ``shallow``: the
    parts' own tensors only, not their children's (the buffers a pipeline's glue modules own).
    """
    parts = [("", roots)] if isinstance(roots, nn.Module) else list(roots)
    whole = origin if origin is not None else roots if isinstance(roots, nn.Module) else None
    owners = first_owners(origin) if origin is not None else {}
    if is_dry_run():  # a meta tensor is its own (shape-only) value
        fresh, tree = False, _Tree([])
    else:  # shapes and ties as built, before any tensor is replaced by a shard
        tree = _Tree([("", whole)] if whole is not None else parts)
    placed: dict[int, torch.Tensor | None] = {}
    cache: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, part in parts:
        for name, mod in [(prefix, part)] if shallow else owner_modules(part, prefix=prefix):
            for store in (mod._parameters, mod._buffers):
                for key, t in list(store.items()):
                    if t is None:
                        continue
                    if id(t) not in placed:
                        qual, src, attr = owners.get(id(t), (name, mod, key))
                        full = t.detach()
                        if fresh or (t.is_meta and not is_dry_run()):
                            if qual not in cache:  # one owner module's full tensors at a time
                                cache.clear()
                                cache[qual] = _values(src, qual, seed, tree)
                            full = cache[qual][attr]
                        placed[id(t)] = _place(keep(qual, attr, full, t), t)
                    new = placed[id(t)]
                    if new is not None:
                        store[key] = new  # type: ignore[assignment]


def _place(new: torch.Tensor | None, old: torch.Tensor) -> torch.Tensor | None:
    """Wrap a parameter's replacement as a parameter with the same requires_grad and placement
    record (an expert's placement, its piece: `plait.state.placement.pieces.carry_mark`)."""
    if new is None or new is old or not isinstance(old, nn.Parameter) or isinstance(new, nn.Parameter):
        return new
    param = nn.Parameter(new, requires_grad=old.requires_grad)
    carry_mark(old, param)
    return param


# ------------------------------------------------------------------ reset, then the init protocol
def _own(mod: nn.Module, key: str) -> torch.Tensor | None:
    return mod._parameters[key] if key in mod._parameters else mod._buffers.get(key)


def _seeded(seed: int, name: str, fn: Callable[[nn.Module], Any], mod: nn.Module) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        with torch.no_grad():
            fn(mod)


def _pattern(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(math.prod(shape)) * 7919 % 127).to(dtype).reshape(shape)


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like ``t`` that no initialisation leaves as it is: NaN, or for integer and
    boolean tensors a fixed pattern of values."""
    if t.is_floating_point() or t.is_complex():
        return torch.full(t.shape, float("nan"), dtype=t.dtype)
    return _pattern(t.shape, t.dtype)


def _unset(now: torch.Tensor | None, hole: torch.Tensor) -> bool:
    """Whether ``now``, in the place of the placeholder ``hole``, still lacks (some of) its values."""
    if now is None or now.is_meta or now.shape != hole.shape:
        return True
    if now is not hole or now.numel() == 0:
        return False
    if now.is_floating_point() or now.is_complex():
        return bool(torch.isnan(now).any())
    return torch.equal(now, _pattern(now.shape, now.dtype))


def _values(mod: nn.Module, name: str, seed: int, tree: _Tree) -> dict[str, torch.Tensor]:
    """`full_values`, with the init protocol's copies made from ``tree``."""
    # On the CPU even inside a caller's `with torch.device("meta")` (a factory that builds on meta
    # and initialises): placeholders and the tensors an init makes would otherwise be shapes.
    with torch.device("cpu"):
        return _values_on_cpu(mod, name, seed, tree)


def _values_on_cpu(mod: nn.Module, name: str, seed: int, tree: _Tree) -> dict[str, torch.Tensor]:
    shell = copy.copy(mod)
    shell._modules = {}
    holes: dict[str, torch.Tensor] = {}  # placeholders that something must fill
    shell._parameters, shell._buffers = {}, {}
    for k, p in mod._parameters.items():
        shell._parameters[k] = None if p is None else nn.Parameter(_placeholder(p), p.requires_grad)
        if p is not None:
            holes[k] = shell._parameters[k]  # type: ignore[assignment]
    for k, b in mod._buffers.items():
        shell._buffers[k] = None if b is None else _placeholder(b) if b.is_meta else b.detach().cpu().clone()
        if b is not None and b.is_meta:
            holes[k] = shell._buffers[k]  # type: ignore[assignment]
    reset = getattr(type(mod), "reset_parameters", None)
    if reset is not None:
        _seeded(seed, name, reset, shell)
    out = {k: t.detach() for k in [*shell._parameters, *shell._buffers] if (t := _own(shell, k)) is not None}
    unset = [k for k, hole in holes.items() if _unset(_own(shell, k), hole)]
    if unset:
        out.update(_from_init_protocol(mod, name, seed, out, unset, tree, reset is not None))
    return out


def _bare(fn: Any) -> TypeGuard[Callable[[nn.Module], Any]]:
    """Whether ``fn`` (an unbound method) can be called with the module alone."""
    if not callable(fn):
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _from_init_protocol(mod: nn.Module, name: str, seed: int, values: dict[str, torch.Tensor],
                        unset: list[str], tree: _Tree, has_reset: bool) -> dict[str, torch.Tensor]:
    """Values of ``mod``'s tensors ``unset`` from the nearest ``init_weights()`` that sets them
    (the module's own first, then its ancestors'), or an error naming them and what to do."""
    found: dict[str, torch.Tensor] = {}
    for where, above in tree.lineage(name, mod):
        init = getattr(type(above), "init_weights", None)
        if not _bare(init):
            continue
        got = tree.run(init, where, above, mod, name, seed, values, unset)
        found.update(got)
        unset = [k for k in unset if k not in got]
        if not unset:
            return found
    raise _refusal(mod, name, unset, has_reset)


def _refusal(mod: nn.Module, name: str, unset: list[str], has_reset: bool) -> Exception:
    kind = type(mod).__name__
    params = [k for k in unset if k in mod._parameters]
    what = ", ".join(f"{'parameter' if k in params else 'buffer'} {k!r}" for k in unset)
    why = (f"its reset_parameters() leaves {'it' if len(unset) == 1 else 'them'} unset" if has_reset
           else "it has no reset_parameters()")
    fix = f"give {kind} a reset_parameters() that sets {'it' if len(unset) == 1 else 'them'}"
    if len(params) < len(unset):  # a buffer: its constructed value is right, if it exists
        return ValueError(
            f"{what} of module {name!r} ({kind}) is computed in __init__ and on the meta device, but {why} "
            "and no init_weights() of it or a module above it sets it: plait cannot know its values. Build "
            f"the model on a real device (e.g. the CPU), {fix}, or an init_weights() that recomputes it")
    return TypeError(
        f"{what} of module {name!r} ({kind}): {why} and no init_weights() of it or a module above it "
        "sets it, so plait cannot initialise it deterministically; "
        f"{fix} (initialising only the module's own tensors), or an init_weights()")


class _Tree:
    """The shapes, dtypes and ties of a model's tensors, recorded before any is replaced (a
    tensor-parallel shard has another shape), and meta-device copies of its subtrees for a module's
    ``init_weights()`` to run on: only the tensors asked for are real there."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module]]) -> None:
        self.parts = list(parts)
        self.stores = {id(m): _record(m) for _, part in self.parts for m in part.modules()}

    def lineage(self, name: str, mod: nn.Module) -> list[tuple[str, nn.Module]]:
        """``mod`` and the modules above it in the recorded model, nearest first."""
        out = [(name, mod)]
        for prefix, part in self.parts:
            rest = name if not prefix else name[len(prefix) + 1:] if name.startswith(prefix + ".") else None
            if rest is None or name == prefix:
                continue
            chain, here, segs = [(prefix, part)], part, rest.split(".")
            for i, seg in enumerate(segs[:-1]):
                here = here._modules.get(seg)  # type: ignore[assignment]
                if here is None:
                    break
                chain.append((".".join(filter(None, [prefix, *segs[: i + 1]])), here))
            return out + chain[::-1]
        return out

    def run(self, init: Callable[[nn.Module], Any], where: str, above: nn.Module, mod: nn.Module, name: str,
            seed: int, values: dict[str, torch.Tensor], unset: list[str]) -> dict[str, torch.Tensor]:
        """Run ``init`` on a copy of ``above``'s subtree on the meta device, where ``mod``'s tensors
        are real (``values``, placeholders for ``unset``); return the ``unset`` ones it set."""
        stores = self._store(mod)
        tensors: dict[int, torch.Tensor] = {}  # id of a recorded tensor -> its tensor in the copy
        for k, spec in stores.items():
            if spec is not None and (k in unset or k in values):
                v = _placeholder(torch.empty(spec[1], dtype=spec[2], device="meta")) if k in unset \
                    else values[k].clone()
                tensors[spec[0]] = nn.Parameter(v, spec[4]) if spec[3] else v
        copies: dict[int, nn.Module] = {}
        try:
            with _SkipMetaWrites():
                _seeded(seed, name, init, self._copy(above, copies, tensors))
        except Exception as e:
            raise ValueError(f"{type(above).__name__}.init_weights() of module {where!r} failed on a meta-"
                             f"device copy, which plait runs for what {type(mod).__name__} {name!r} cannot "
                             f"reset ({', '.join(unset)}): {e}. Build the model on a real device (e.g. the "
                             "CPU) or give the module a reset_parameters()") from e
        target = copies.get(id(mod))
        got = {}
        for k in unset:
            spec, now = stores.get(k), None if target is None else _own(target, k)
            if spec is None or now is None:
                continue
            hole = tensors[spec[0]]
            if _kind(now) == _kind(hole) and not _unset(now, hole):
                got[k] = now.detach().to("cpu", hole.dtype)
        return got

    def _store(self, m: nn.Module) -> dict[str, _Spec | None]:
        if id(m) not in self.stores:  # not recorded (outside the parts): as it is now
            self.stores[id(m)] = _record(m)
        return self.stores[id(m)]

    def _copy(self, m: nn.Module, copies: dict[int, nn.Module],
              tensors: dict[int, torch.Tensor]) -> nn.Module:
        if id(m) in copies:  # a module at two places stays one
            return copies[id(m)]
        c = copies[id(m)] = copy.copy(m)
        mine: dict[str, torch.Tensor | None] = {}
        for k, spec in self._store(m).items():
            if spec is not None and spec[0] not in tensors:  # tied tensors stay one
                meta = torch.empty(spec[1], dtype=spec[2], device="meta")
                tensors[spec[0]] = nn.Parameter(meta, spec[4]) if spec[3] else meta
            mine[k] = None if spec is None else tensors[spec[0]]
        c._parameters = {k: mine[k] for k in m._parameters}  # type: ignore[misc]
        c._buffers = {k: mine[k] for k in m._buffers}
        c._modules = {k: None if s is None else self._copy(s, copies, tensors) for k, s in m._modules.items()}
        return c


class _SkipMetaWrites(TorchFunctionMode):
    """In-place writes of values into meta tensors do nothing: skipped, not dispatched (torch runs
    ``normal_`` and its kind on meta through Python references, milliseconds each, which a model's
    ``init_weights()`` over every other tensor of the copy would add up to seconds)."""

    _KEEP = frozenset({"resize_", "resize_as_", "set_", "requires_grad_", "as_strided_", "squeeze_",
                       "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_", "share_memory_"})

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Any = None) -> Any:
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        if (name.endswith("_") and not name.startswith("_") and name not in self._KEEP
                and isinstance(first, torch.Tensor) and first.is_meta):
            return first
        return func(*args, **kwargs)


def _kind(t: torch.Tensor) -> tuple[bool, bool]:
    return t.is_complex(), t.is_floating_point()


def _record(m: nn.Module) -> dict[str, _Spec | None]:
    return {k: None if t is None else (id(t), t.shape, t.dtype, isinstance(t, nn.Parameter), t.requires_grad)
            for k, t in [*m._parameters.items(), *m._buffers.items()]}
