"""One rank's training step, rehearsed on the meta device: what `plait plan` predicts from.

`rehearse` builds the layout exactly as `plait train` does (the same `build_model`, the same
step), inside `plait.runtime.env.dry_run`: one process stands in for one rank of the full world, every
process group is a fake one and every tensor a shape. It runs two steps (the first makes the
optimizer state) and measures the second:

* memory: live tensor storage op by op (`plait.runtime.live_memory.LiveStorageBytes` on the meta device),
  its peak and what the peak is made of: parameters, gradients, optimizer state, communication
  buffers (DDP's buckets), FSDP's gathered units, and activations (everything else: tensors
  saved for backward and the temporaries of the moment);
* activations per block: the live bytes each transformer block adds in its first forward;
* floating-point operations (by the formulas of `torch.utils.flop_counter`), recomputation
  included, and the number of ops (their host time matters on CPUs);
* communication: `plait.comm`'s own count of every collective, per axis (calls, logical and wire
  bytes), the figure a real run's counters give.

Nothing is allocated and no value is real, so only shapes, bytes and counts are read. Ranks of
one pipeline stage hold the same shapes, so one per stage is rehearsed; `rehearse_layout`
extrapolates a deep GPT from two shallow depths; `measured` is the same step on real ranks, the
validation's other side; `build_only` is ``plait plan --dry-run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from plait._torch_compat import cpu_flash_attention, cpu_flash_attention_backward, drop_library
from plait.app.config import TrainConfig
from plait.pipeline import Pipeline
from plait.runtime import comm, env
from plait.runtime.live_memory import LiveStorageBytes, storage_key
from plait.runtime.mesh import Mesh
from plait.state.blocks import blocks

# What the peak is made of, in the order reports show them.
CATEGORIES = ("parameters", "gradients", "optimizer state", "communication buffers", "fsdp gathered units",
              "activations")


@dataclass
class Rehearsal:
    """One rank's measured step. Bytes per category at the peak, the peak itself, the state sizes
    between steps, per-block activation bytes, FLOPs and communication per axis."""

    rank: int
    stage: int  # pp coordinate
    peak: int
    at_peak: dict[str, int]
    parameters: int
    gradients: int
    optimizer: int
    block_activations: list[int]
    flops: float
    comm: dict[str, dict[str, float]]  # "op@axis" -> calls, bytes, wire_bytes
    microbatches_in_flight: int = 1
    ops: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stage_ranks(cfg: TrainConfig) -> list[int]:
    """One rank per pipeline stage coordinate (the first of each): ranks of one stage hold the same
    shapes, so one stands in for all."""
    per_stage = cfg.parallel.nproc // cfg.parallel.pp
    return [s * per_stage for s in range(cfg.parallel.pp)]


def _parts(model: nn.Module | Pipeline) -> list[nn.Module]:
    """The modules this rank runs: the model, or a pipeline's stages."""
    return [model] if isinstance(model, nn.Module) else list(model.stages.values())


def _tensors_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [_local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """What holds a tensor's bytes on this rank: a DTensor's local tensor (FSDP's parameters)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in map(_local, tensors):
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t) for t in tensors}


def _fsdp_flats(model: nn.Module | Pipeline) -> list[Any]:
    from plait.fsdp.wrapper import FullyShardedDataParallel

    mods = _parts(model)
    return [f for m in mods for sub in m.modules() if isinstance(sub, FullyShardedDataParallel)
            for u in sub.units for f in u.flats]


def _ddp_buckets(model: nn.Module | Pipeline) -> list[torch.Tensor]:
    from plait.ddp.wrapper import DistributedDataParallel

    mods = _parts(model)
    found: list[torch.Tensor] = []
    for m in mods:
        for sub in m.modules():
            if isinstance(sub, DistributedDataParallel):
                found.extend(b.buffer for b in sub._buckets)
    return found


def _buffers(model: nn.Module | Pipeline) -> list[torch.Tensor]:
    mods = _parts(model)
    return [b for m in mods for b in m.buffers()]


def _blocks(model: nn.Module | Pipeline) -> list[nn.Module]:
    """The repeated blocks of each stage (`plait.state.blocks`), as activation checkpointing picks them."""
    return [m.get_submodule(n) for m in _parts(model) for n in blocks(m, outermost=True)]


def step_once(model: nn.Module | Pipeline, opt: torch.optim.Optimizer, cfg: TrainConfig, mesh: Mesh,
              device: torch.device) -> None:
    """One `plait train` step on this rank's share of a global batch of token ids."""
    import plait
    from plait.app.step import moe_layers_of, rank_tokens, train_step
    from plait.models.gpt import lm_loss
    from plait.tp.apply import loss_fn_for

    per_rank = cfg.data.batch_size // mesh.size(("dp", "fsdp"))
    vocab = 256
    x = torch.randint(0, vocab, (per_rank, cfg.seq_len), device=device)
    y = torch.randint(0, vocab, (per_rank, cfg.seq_len), device=device)
    x, y = rank_tokens((x, y), device, mesh)
    loss_fn = lm_loss if isinstance(model, Pipeline) else loss_fn_for(model)
    scaler = plait.GradScaler(mesh, enabled=cfg.parallel.mixed_precision == "fp16")
    train_step(model, opt, x, y, cfg, mesh, loss_fn, scaler, moe_layers_of(model))


def make_optimizer(model: nn.Module | Pipeline, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                             betas=(0.9, 0.95))


_CPU_FLASH = cpu_flash_attention
_CPU_FLASH_BACKWARD = cpu_flash_attention_backward


# torch's FLOP counter knows the CUDA flash kernels but not the CPU one that real CPU steps run:
# without these, a CPU run's attention would count nothing.
@register_flop_formula(_CPU_FLASH, get_raw=True)
def _cpu_flash_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                     **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@register_flop_formula(_CPU_FLASH_BACKWARD, get_raw=True)
def _cpu_flash_backward_flops(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """On the meta device, `scaled_dot_product_attention` has no fused kernel to pick and falls back
    to the composite that materializes the attention matrix, which no device runs. Inside, it runs
    the fused kernel's own op instead (the CPU one; CUDA's flash kernel keeps the same tensors for
    backward: the output and a log-sum-exp per row). Registered below autograd's dispatch for meta
    tensors only, so a recomputation in backward takes the same path."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _fused_sdpa, "AutogradMeta")
    try:
        yield
    finally:
        drop_library(lib)


def _fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    return _CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class StepMeter(LiveStorageBytes):
    """Live storage (`LiveStorageBytes`) and floating-point operations of every op, by the formulas
    of torch's FLOP counter (its own mode installs module hooks that a split backward cannot run
    under)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flops = 0
        self.ops = 0  # dispatched ops: each costs host time, which dominates small models

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.ops += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


class _BlockMeter:
    """Live bytes each block adds in its forward (the first forward of the step only)."""

    def __init__(self, tracker: LiveStorageBytes, blocks: list[nn.Module]) -> None:
        self.tracker, self.added = tracker, [0] * len(blocks)
        self.done = [False] * len(blocks)
        self._handles = []
        for i, b in enumerate(blocks):
            self._handles.append(b.register_forward_pre_hook(self._pre(i)))
            self._handles.append(b.register_forward_hook(self._post(i)))
        self._start = [0] * len(blocks)

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if not self.done[i] and torch.is_grad_enabled():
                self._start[i] = self.tracker.now()
        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if not self.done[i] and torch.is_grad_enabled():
                self.added[i] = self.tracker.now() - self._start[i]
                self.done[i] = True
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def measure_step(model: nn.Module | Pipeline, opt: torch.optim.Optimizer, cfg: TrainConfig, mesh: Mesh,
                 device: torch.device, scan_gc: bool) -> dict[str, Any]:
    """Run one more step under the live-memory tracker, the FLOP counter and fresh comm counts;
    return the raw figures (shared by the rehearsal on meta and the measured run on a device)."""
    owned = list(model.parameters())
    params = [_local(p) for p in owned]
    buffers = _buffers(model)
    state = _tensors_of(opt)
    flats = _fsdp_flats(model)
    # Without the garbage collector's view (meta tensors outside the layout would count), the
    # roots are everything a step starts with: the state, and the wrappers' persistent buffers.
    kept = [*_ddp_buckets(model), *(f.buf for f in flats), *(f.shard for f in flats)]
    roots = None if scan_gc else [*params, *buffers, *state, *kept]
    tracker = StepMeter(device.type, roots=roots, keep_peak_storages=True)
    meter = _BlockMeter(tracker, _blocks(model))
    with tracker, comm.counting() as counts:
        step_once(model, opt, cfg, mesh, device)
    meter.remove()
    stats = counts.as_dict()
    grads = [_local(p.grad) for p in owned if p.grad is not None]
    groups = {"parameters": _keys([*params, *buffers]), "gradients": _keys(grads),
              "optimizer state": _keys(_tensors_of(opt)), "communication buffers": _keys(_ddp_buckets(model)),
              "fsdp gathered units": _keys(f.buf for f in flats)}
    at_peak = dict.fromkeys(CATEGORIES, 0)
    for key, size in tracker.peak_storages.items():
        where = next((name for name, keys in groups.items() if key in keys), "activations")
        at_peak[where] += size
    return dict(peak=tracker.peak, at_peak=at_peak,
                start=tracker.start, parameters=_bytes([*params, *buffers]), gradients=_bytes(grads),
                optimizer=_bytes(_tensors_of(opt)), block_activations=meter.added,
                flops=float(tracker.flops), ops=tracker.ops, comm=stats)


def rehearse(cfg: TrainConfig, rank: int = 0, mailbox: dict[tuple[int, int], list[Any]] | None = None
             ) -> Rehearsal:
    """`plait train`'s step under ``cfg`` as rank ``rank`` would run it, on the meta device. A later
    pipeline stage needs the ``mailbox`` its earlier stages' rehearsals filled (`rehearse_stages`)."""
    from plait.app.step import build_model

    with env.dry_run(cfg.parallel.nproc, rank, mailbox) as meta, fused_attention_on_meta():
        mesh = cfg.mesh()
        model = build_model(cfg, mesh, meta)
        opt = make_optimizer(model, cfg)
        step_once(model, opt, cfg, mesh, meta)  # the optimizer state exists from the second step on
        raw = measure_step(model, opt, cfg, mesh, meta, scan_gc=False)
        in_flight = _in_flight(model, mesh)
        stage = mesh.coords["pp"]
        del model, opt
    return Rehearsal(rank=rank, stage=stage, peak=raw["peak"], at_peak=raw["at_peak"],
                     parameters=raw["parameters"], gradients=raw["gradients"], optimizer=raw["optimizer"],
                     block_activations=raw["block_activations"], flops=raw["flops"],
                     comm=raw["comm"], microbatches_in_flight=in_flight,
                     ops=raw["ops"])


def build_only(cfg: TrainConfig) -> dict[str, Any]:
    """`plait plan --dry-run`: the layout built at full size on the meta device, as the first rank of
    each pipeline stage holds it, with its optimizer state made (one step on stand-in gradients):
    the true per-rank parameter, gradient and optimizer bytes of the real sharding. No forward
    runs, so any world size and any model size take seconds."""
    import time

    from plait.app.step import build_model

    stages = []
    mailbox: dict[tuple[int, int], list[Any]] = {}
    for rank in stage_ranks(cfg):
        t0 = time.perf_counter()
        with env.dry_run(cfg.parallel.nproc, rank, mailbox) as meta:
            mesh = cfg.mesh()
            model = build_model(cfg, mesh, meta)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = make_optimizer(model, cfg)
            for p in params:
                p.grad = torch.empty_like(p)
            opt.step()
            stages.append({"stage": mesh.coords["pp"], "rank": rank, "mesh": dict(mesh.shape),
                           "parameters": sum(_local(p).numel() for p in model.parameters()),
                           "parameter_bytes": _bytes([*model.parameters(), *_buffers(model)]),
                           "gradient_bytes": _bytes(p.grad for p in params if p.grad is not None),
                           "optimizer_bytes": _bytes(_tensors_of(opt)),
                           "groups": len(comm.created_groups()), "seconds": time.perf_counter() - t0})
            del model, opt, params
    return {"world": cfg.parallel.nproc, "stages": stages}


def rehearse_stages(cfg: TrainConfig) -> list[Rehearsal]:
    """One rehearsal per pipeline stage, in stage order, each receiving the shapes the one before sent.
    With several stages per rank (interleaved, V schedules) the chain of shapes goes round the ranks
    more than once: a rank that waits for shapes not sent yet is rehearsed again in the next round,
    after its senders."""
    mailbox: dict[tuple[int, int], list[Any]] = {}
    done: dict[int, Rehearsal] = {}
    ranks = stage_ranks(cfg)
    for _ in range(2 * max(cfg.parallel.chunks, 2) + 1):
        for r in ranks:
            if r not in done:
                try:
                    done[r] = rehearse(cfg, r, mailbox)
                except comm.MailNotSent:
                    continue
        if len(done) == len(ranks):
            return [done[r] for r in ranks]
    raise RuntimeError(f"plait plan: the pipeline's stages never received their shapes (ranks "
                       f"{sorted(set(ranks) - set(done))}); this schedule cannot be rehearsed")


def rehearse_layout(cfg: TrainConfig) -> list[Rehearsal]:
    """The rehearsals of ``cfg``'s pipeline stages, at the model's full depth or, for a deep GPT,
    extrapolated from two shallow ones: every block of plait's GPT is the same, so each figure
    (bytes by category, FLOPs, collectives' calls and bytes) is an affine function of the blocks
    per stage; two depths give it exactly (the calls of size-capped buckets only
    nearly). The peak too, as long as it falls at the same point of the step at both depths (the
    start of backward, or the last stage's loss), as it does."""
    own_gpt = cfg.model.hf_config is None and getattr(cfg, "make_model", None) is None
    layers = cfg.gpt_config().n_layers if own_gpt else None
    pp = cfg.parallel.pp * max(cfg.parallel.chunks, 1)
    d1, d2 = 2 * pp, 3 * pp  # not one block: FSDP's first and last units are then one and the same
    if layers is None or layers <= d2 or layers % pp:
        return rehearse_stages(cfg)
    lo, hi = (rehearse_stages(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, layers=d)))
              for d in (d1, d2))
    t = (layers - d1) / (d2 - d1)
    out = [_extrapolate(a, b, t, layers // pp) for a, b in zip(lo, hi)]
    # Where the peak fell elsewhere at the two depths (its parts then move apart), the line through
    # them says nothing: rehearse the full depth instead.
    if any(v < 0 for r in out for v in r.at_peak.values()):
        return rehearse_stages(cfg)
    return out


def _extrapolate(a: Rehearsal, b: Rehearsal, t: float, blocks: int) -> Rehearsal:
    def at(x: float, y: float) -> float:
        return x + t * (y - x)

    def whole(x: float, y: float) -> int:
        return round(at(x, y))

    comm_stats = {k: {f: at(a.comm.get(k, {}).get(f, 0.0), v[f]) for f in v} for k, v in b.comm.items()}
    per_block = b.block_activations[-1] if b.block_activations else 0
    return Rehearsal(rank=b.rank, stage=b.stage, peak=whole(a.peak, b.peak),
                     at_peak={c: whole(a.at_peak[c], b.at_peak[c]) for c in CATEGORIES},
                     parameters=whole(a.parameters, b.parameters), gradients=whole(a.gradients, b.gradients),
                     optimizer=whole(a.optimizer, b.optimizer), block_activations=[per_block] * blocks,
                     flops=at(a.flops, b.flops), comm=comm_stats,
                     microbatches_in_flight=b.microbatches_in_flight,
                     ops=whole(a.ops, b.ops),
                     extra={"extrapolated_from_blocks_per_stage": [len(a.block_activations),
                                                                   len(b.block_activations)]})


def _in_flight(model: nn.Module | Pipeline, mesh: Mesh) -> int:
    """The most microbatches whose activations this rank holds at once (1 without a pipeline)."""
    if not isinstance(model, Pipeline):
        return 1
    from plait.pipeline.actions import Kind

    held = most = 0
    for a in model.sched.actions[mesh.coords["pp"]]:
        if a.kind == Kind.F:
            held += 1
            most = max(most, held)
        elif a.kind in (Kind.BW, Kind.W):
            held -= 1
    return most


def measured(args: dict[str, Any]) -> dict[str, Any]:
    """On each rank of a real job (a `plait.testing.RankPool`): the same step as `rehearse`,
    measured on the rank's device (CPU: live storage of every tensor in the process), then
    ``args["timed"]`` more steps timed. The validation's other side."""
    import time

    import torch.distributed as dist

    from plait.app.step import build_model

    cfg = TrainConfig.from_flags(**args["flags"])
    device = env.device()
    # What the process held before this layout (a pool's earlier tasks) is not this step's.
    baseline = LiveStorageBytes(device.type).start if device.type == "cpu" else 0
    mesh = cfg.mesh()
    model = build_model(cfg, mesh, device)
    opt = make_optimizer(model, cfg)
    step_once(model, opt, cfg, mesh, device)
    raw = measure_step(model, opt, cfg, mesh, device, scan_gc=True)
    times = []
    for _ in range(args.get("timed", 0)):
        dist.barrier()
        t0 = time.perf_counter()
        step_once(model, opt, cfg, mesh, device)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    raw.update(times=times, rank=dist.get_rank(), stage=mesh.coords["pp"], peak=raw["peak"] - baseline,
               baseline=baseline)
    mesh.destroy() if hasattr(mesh, "destroy") else None
    return raw
