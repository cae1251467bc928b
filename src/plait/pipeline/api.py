"""`plait.pipeline(...)`: split a model into stages, place them on the ``pp`` axis, run schedules."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from plait._torch_compat import map_tensors
from plait.pipeline.actions import Slot
from plait.pipeline.arguments import CustomSchedule, split_batch
from plait.pipeline.parts import PipelineParts
from plait.pipeline.parts import split as split_stages
from plait.pipeline.runtime import Executor, busy_fraction
from plait.pipeline.schedules import Schedule
from plait.pipeline.split import named_view
from plait.pipeline.ties import TiedCopy, drop_earlier_sums, sync_grads
from plait.pipeline.wrapping import StageWrapper, StateHoldingStage
from plait.runtime import comm
from plait.runtime.mesh import Mesh
from plait.state.materialize import is_meta
from plait.state.names import plain_name
from plait.state.placement.pieces import mark_grads, mark_piece
from plait.state.placement.records import TPInfo, tp_info

if TYPE_CHECKING:
    from plait.state.clip import GradParts


class Pipeline:
    """One rank's part of a pipelined model. Build it with `plait.pipeline`.

    ``step(inputs, targets)`` runs forward and backward of the whole batch as ``microbatches``
    microbatches on the schedule, leaves the gradients in ``.grad`` of this rank's parameters and
    returns the batch's mean loss (a float64 scalar) on every rank of the ``pp`` axis. Pass the
    same ``inputs`` on every ``pp`` rank: every stage runs the model's forward on them
    (`plait.pipeline.replay`), so the glue between layers (position ids, masks) is computed where
    it is used; ``targets`` are read on the rank holding the last stage.
    ``loss_fn(output, target)`` receives exactly what the model's forward returns.

    A weight shared by stages on different pp ranks (a tied embedding and LM head) is kept as one
    copy per rank, initialised from its first owner; `step` sums the copies' gradients (each step's
    once, also when several steps accumulate before an optimizer step). Under tensor
    parallelism each copy is this rank's tp shard, and the sum runs between the pp ranks of the same
    tp coordinate (the plan must split every use alike, as vocabulary-parallel embedding and head do).

    `plait.pipeline` builds it from a model, `plait.parallelize` from a plan (it applies tensor,
    context and expert parallelism, checkpointing, mixed precision and DDP or FSDP to each part
    `split` gave this rank, then hands them here): ``stages`` are the built parts (wrapped by
    ``wrapper``, whose stages' gradients accumulate over the microbatches and are reduced in each
    stage's last backward of the step), ``tp_module`` this rank's tensor-parallel parts under their
    original names (``tp_info`` reads it), ``w_communicates`` whether a weight-gradient pass runs
    collectives (then W's run exactly where the schedule lists them).
    """

    def __init__(self, parts: PipelineParts, stages: Mapping[int, nn.Module] | None = None, *,
                 microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor],
                 wrapper: StageWrapper | None = None, tp_module: nn.Module | None = None,
                 w_communicates: bool = False) -> None:
        if not callable(loss_fn):
            raise TypeError(f"pipeline: loss_fn must be callable (output, target) -> scalar, got {loss_fn!r}")
        self.parts, self.sched, self.microbatches, self.loss_fn = parts, parts.schedule, microbatches, loss_fn
        self.rank, self.group, self.pp_ranks = parts.rank, parts.group, parts.pp_ranks
        self.stage_names, self.device, self._replay = parts.stage_names, parts.device, parts.replay
        self.tp_module, self._wrapper, self._inner = tp_module, wrapper, parts.stages
        self.stages: dict[int, nn.Module] = dict(stages if stages is not None else parts.stages)
        # Each stage's state-dict keys, under the original names (a wrapper that holds the state in
        # its own form answers for these).
        self._state_keys = {s: set(st.state_dict(keep_vars=True)) for s, st in self._inner.items()}
        # Copies of weights shared with another pp rank, with the group that sums their gradients.
        ties = parts.ties
        held = {n: p for s in self._inner.values() for n, p in s.qualified_parameters()}
        self._tied = [TiedCopy(next(held[n] for n in tie.names if n in held), g, self.rank == tie.ranks[0])
                      for tie, g in zip(ties, parts.tie_groups) if g is not None]
        # Each name of a weight tied across pp ranks -> its first owner's (one optimizer state).
        self.tied_names: dict[str, str] = {n: tie.names[0] for tie in ties for n in tie.names}
        self._my_segs = parts.my_segments()
        # A module that adds a loss of its own in each forward (an MoE layer's balancing loss,
        # `aux_loss_scale`) weighs it as the step weighs that forward's microbatch loss: 1/m of the
        # batch's mean. Left at 1, its gradient would be m times the one-process run's.
        for _, seg in self._my_segs:
            for sub in seg.modules():
                if hasattr(sub, "aux_loss_scale"):
                    sub.aux_loss_scale = 1 / microbatches  # type: ignore[assignment]
        backend = torch.distributed.get_backend()
        # W's pulled into waits (a helper thread watches the receives): on Gloo only, where a
        # receive's wait() returns when the data is there (NCCL's returns at once, ordering streams),
        # and not when W communicates (``w_communicates``: sequence parallelism, or a checkpointed
        # tensor-parallel block that W recomputes, as on the first stage, whose B computes nothing;
        # data parallelism, whose collectives would then come in another order on each replica),
        # which would desynchronize ranks.
        fill_w = not w_communicates and backend == "gloo" and wrapper is None
        self.exec = Executor(self.sched, self.stages, self.rank, self.pp_ranks, self.group, loss_fn,
                             self.device, links=parts.links, fill_w=fill_w, carry=self._replay,
                             **self._wrapped_stage_hooks())
        self._fwd_sched = self.sched.forward_part().validate()
        self.bubble_fraction = 0.0  # idle / step time of this rank in the last step
        self.step_time = 0.0  # seconds, this rank's start of the step to the end of the whole pipeline
        # Each rank holds some stages' parameters: torch's clip would take them for the whole model's.
        p = self.sched.ranks
        named = list(self.named_parameters()) if p > 1 else []
        for name, prm in named:
            mark_piece(prm, f"'{name}' of pipeline stage(s) {sorted(self._inner)} (pp={p})")
        self._pieces = [prm for _, prm in named]  # `step` marks their new gradients

    def _wrapped_stage_hooks(self) -> dict[str, Any]:
        """The executor's view of the stage wrapper: each stage's autograd leaves, and the context
        its actions run in (local accumulation, or the reducing last backward)."""
        w = self._wrapper
        if w is None:
            return {}
        return {"params": {s: w.leaves(m) for s, m in self.stages.items()},
                "grad_sync": lambda s, reduce: w.grad_sync(self.stages[s], reduce)}

    # ------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer steps on this rank, each once: the stages' parameters under their names
        in the original model (FSDP's DTensor shards too), or a wrapper's own (``stages.<s>.<name>``)."""
        seen: set[int] = set()
        for s in sorted(self.stages):
            original = {id(p): n for n, p in self._inner[s].named_parameters()}
            for name, prm in self.stages[s].named_parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield original.get(id(prm), f"stages.{s}.{name}"), prm

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, prm in self.named_parameters():
            yield prm

    # Modes, as on a module: dropout and the like in this rank's stages (the glue between them too).
    @property
    def training(self) -> bool:
        """Whether this rank's stages are in training mode (`train`, `eval`)."""
        return all(st.training for st in self.stages.values())

    def train(self, mode: bool = True) -> Pipeline:
        """Put this rank's stages in training (``mode=True``) or evaluation mode, as
        `torch.nn.Module.train` does; `step` and `eval_step` then run in it (`eval_step` always
        evaluates). Call it on every pp rank: the ranks' modes are not compared."""
        for st in self.stages.values():
            st.train(mode)
        return self

    def eval(self) -> Pipeline:
        """``train(False)``."""
        return self.train(False)

    def state_module(self) -> nn.Module:
        """This rank's stages as one module under their names in the original model: its
        ``state_dict()`` has the original keys (checkpoints use it)."""
        if self._wrapper is not None and not self._wrapper.keeps_parameters:
            raise ValueError("pipeline: the stages are FSDP-sharded (flat shards, not the model's "
                             "tensors); state dicts and checkpoints of pipelines with FSDP stages are not "
                             "supported yet")
        return self.tp_module if self.tp_module is not None else named_view(self._my_segs)

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state under the original model's names (see `state_module`)."""
        return self.state_module().state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> Any:
        return self.state_module().load_state_dict(state, strict=strict)

    # Full state and the checkpoint protocol (`plait.state.state_dict`, `plait.state.checkpoint.protocol`).
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (a collective over tp and pp): this rank's stages
        at full size (gathered over tp under tensor parallelism), then every pp rank's."""
        from plait.state.state_dict import full_state_dict, union_over, with_other_experts

        own = self._stages_holding_state()
        if own is not None:
            mine = {k: v for st, _ in own for k, v in st.full_state_dict().items()}
        else:
            mine = full_state_dict(self.state_module())
            # Expert parallelism records its split on each stage (`stage_steps`), which the view
            # of this rank's modules does not include: each stage's experts are gathered over ep.
            for st in self._inner.values():
                mine = with_other_experts(st, mine)
        return union_over(mine, self.group, self.pp_ranks)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the whole model's full state: each rank takes its own stages' entries (no
        communication; entries of other ranks' stages are not checked here)."""
        from plait.state.state_dict import load_full_state_dict

        own = self._stages_holding_state()
        if own is not None:
            for st, keys in own:
                st.load_full_state_dict({k: state[k] for k in keys})
            return
        module = self.state_module()
        mine = {plain_name(k) for k in module.state_dict(keep_vars=True)}  # a full state dict's names
        load_full_state_dict(module, {k: v for k, v in state.items() if k in mine})

    def checkpoint_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's stages' entries; a weight tied across pp ranks keeps one optimizer state,
        under its first owner's name (``tied_names``)."""
        from plait.state.checkpoint.protocol import module_state

        own = self._stages_holding_state()
        if own is None:
            return module_state(self.state_module(), optimizer, self.tied_names)
        out: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
        for st, _ in own:  # each FSDP stage's sharded entries, already under the original names
            for part, entries in st.checkpoint_state(optimizer).items():
                out[part].update(entries)
        return out

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: Any) -> None:
        from plait.state.checkpoint.protocol import load_module_state

        own = self._stages_holding_state()
        if own is None:
            load_module_state(self.state_module(), optimizer, state, self.tied_names)
            return
        for st, keys in own:
            st.load_checkpoint_state({**state, "model": {k: state["model"][k] for k in keys}}, optimizer)

    def _stages_holding_state(self) -> list[tuple[StateHoldingStage, set[str]]] | None:
        """(wrapped stage, its state-dict keys) per stage when the wrapper holds the stages' state
        in its own form (FSDP's flat shards) and answers the state protocols itself; else None."""
        if self._wrapper is None or self._wrapper.keeps_parameters:
            return None
        return [(cast(StateHoldingStage, self.stages[s]), self._state_keys[s]) for s in sorted(self.stages)]

    def grad_copies(self) -> list[torch.Tensor]:
        """Gradients of this rank's copies of weights tied across pp ranks that are not the first
        owner's: equal to the first owner's after `step`, so `plait.state.clip` scales them but counts
        only the first owner's."""
        firsts = set(self.tied_names.values())
        names: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for st in self._inner.values():
            for n, p in st.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), (p, []))[1].append(n)
        return [p.grad for p, ns in names.values() if p.grad is not None
                and any(n in self.tied_names for n in ns) and not any(n in firsts for n in ns)]

    def grad_norm_parts(self) -> GradParts:
        """Each stage's parts as its wrapper (or tensor parallelism) describes them, all disjoint over
        pp as well, since stages hold disjoint parameters (`plait.state.clip`). A weight tied across pp
        ranks counts once: the copies that are not its first owner's (`grad_copies`) are left out."""
        from plait.state.clip import grad_norm_parts

        # A weight two of this rank's stages share (tied embedding and LM head on one rank of a V)
        # counts once too; `seen` starts with this rank's copies of weights first owned on another rank.
        seen = {id(g) for g in self.grad_copies()}
        parts: GradParts = {}
        for s in sorted(self.stages):
            for key, grads in grad_norm_parts(self.stages[s]).items():
                new = [g for g in grads if id(g) not in seen]
                seen.update(id(g) for g in new)
                parts.setdefault((self.group, *key), []).extend(new)
        return parts

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate gradients without the data-parallel reduction; the first step
        after the block reduces everything accumulated (like DDP's and FSDP's ``no_sync``)."""
        old, self.exec.reduce_grads = self.exec.reduce_grads, False
        try:
            yield
        finally:
            self.exec.reduce_grads = old

    @property
    def tp_info(self) -> TPInfo | None:
        """The `plait.tp.TPInfo` of this rank's stages (None without tensor parallelism)."""
        return None if self.tp_module is None else tp_info(self.tp_module)

    @property
    def schedule(self) -> Schedule:
        return self.sched

    @property
    def timeline(self) -> list[Slot]:
        """This rank's measured actions of the last step (seconds from the step's start)."""
        return self.exec.timeline

    def gather_timelines(self) -> list[list[Slot]]:
        """Every pp rank's last timeline (a collective on the ``pp`` axis: call on all of them)."""
        return comm.all_gather_object(self.exec.timeline, self.group)

    # ------------------------------------------------------------------ steps
    def step(self, inputs: Any, targets: Any, *, loss_scale: float | None = None) -> torch.Tensor:
        """Forward and backward of the whole batch; returns its mean loss on every pp rank.

        ``loss_scale``: backward runs on the loss times this (fp16 loss scaling: pass
        ``plait.GradScaler.get_scale()``, then unscale and step through the scaler); the returned
        loss is not scaled."""
        self.exec.loss_scale = loss_scale
        try:
            return self._step(self.sched, inputs, targets, train=True)
        finally:
            self.exec.loss_scale = None

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any = None) -> Any:
        """Forward only (the schedule's forwards, in order). With ``targets``: the mean loss on every
        pp rank; without: on the last stage's rank the model's outputs, concatenated when they are
        tensors, else one per microbatch (e.g. ``ModelOutput``s); None elsewhere."""
        modes = {s: st.training for s, st in self.stages.items()}
        for st in self.stages.values():
            st.eval()
        try:
            return self._step(self._fwd_sched, inputs, targets, train=False)
        finally:
            for s, st in self.stages.items():
                st.train(modes[s])

    def _step(self, sched: Schedule, inputs: Any, targets: Any, train: bool) -> Any:
        m, S = self.microbatches, self.sched.stages
        mb_in = split_batch(inputs, m, "inputs")
        holds_last = (S - 1) in self.stages
        if targets is None and holds_last and train:
            raise ValueError("pipeline.step: targets are required on the rank holding the last stage")
        mb_tg = None if targets is None else split_batch(targets, m, "targets")
        mb_in = [tuple(t.to(self.device) for t in x) for x in mb_in]
        self._replay.prepare(mb_in[0])  # the dataflow of this input signature (a dataflow trace, once)
        key = tuple((tuple(t.shape), t.dtype) for t in mb_in[0])
        metas = self.exec.exchange_meta(key, mb_in[0])
        if mb_tg is not None and holds_last:
            mb_tg = [map_tensors(lambda x: x.to(self.device), t) for t in mb_tg]
        if train:
            drop_earlier_sums(self._tied)
        loss_sum, outs = self.exec.run(sched, metas, mb_in, mb_tg if holds_last else None, train)
        if train:
            sync_grads(self._tied)
            mark_grads(self._pieces)  # gradients a wrapper assigned (FSDP's) are marked too
        if targets is None and not train:
            self._measure(self.exec.step_time)
            if not holds_last:
                return None
            return torch.cat(outs) if isinstance(outs[0], torch.Tensor) else outs
        # float64 on every pp rank (they must agree on the dtype, and only the last stage knows
        # the loss's): a float64 model's loss keeps its precision, a lower one loses nothing.
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if loss_sum is not None:
            loss.copy_(loss_sum / m)
        # The loss lives on the last stage's rank; every pp rank returns it. An all-reduce (the
        # other ranks add zero) rather than a broadcast: it returns only once every rank is done,
        # so the step time below spans the whole pipeline, including the idle tail of a rank
        # that finished its actions early (part of the bubble, as in the theory).
        comm.all_reduce(loss, self.group)
        self._measure(time.perf_counter() - self.exec.t0)
        return loss

    def _measure(self, step_time: float) -> None:
        self.step_time = step_time
        self.bubble_fraction = 1.0 - busy_fraction(self.exec.timeline, step_time)


def pipeline(module: nn.Module, mesh: Mesh, split: str | Sequence[str] = "auto",
             schedule: str | CustomSchedule = "1f1b", microbatches: int = 4,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, chunks: int = 1,
             seed: int = 0, device: torch.device | str | None = None,
             tp_plan: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
             p2p: str = "auto") -> Pipeline:
    """Pipeline ``module`` over the mesh's ``pp`` axis; see `Pipeline`.

    Any model: every stage runs the model's unchanged forward with the other stages' layers
    stood in for, and whatever crosses a cut (residuals, keyword arguments, values in a
    ``ModelOutput``) is sent; see `plait.pipeline.replay` and `plait.pipeline.flow`.

    ``split``: ``"auto"`` (balanced by parameter count) or the segment names that start stages
    1.. (e.g. ``["layers.4"]``, ``["model.layers.4"]`` for a Hugging Face Llama; segments are
    listed by `plait.pipeline.split.segments`); ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
    ``"zb-h1"``, ``"zbv"``, ``"dualpipev"`` (two stages per rank in a V: ``chunks`` 1 or 2), a
    `Schedule` or per-rank action lists; ``chunks``: stages per rank; ``seed``:
    the `plait.init_weights` seed used to materialize a meta-device model.

    Tensor parallelism inside the stages (pp x tp), and data parallelism across pipelines, are
    composed by `plait.parallelize`: ``plait.parallelize(model, mesh, plait.ParallelPlan(tp=plan,
    data="none", pp_microbatches=4))`` builds the same pipeline with each rank's stages
    tensor-parallel; ``tp_plan`` and ``sequence_parallel`` here are refused with that advice.

    ``p2p``: how stages exchange data. Either way every receive of a step is posted when it
    starts. ``"tagged"``: all messages on the default group, matched by tag (Gloo).
    ``"directed"``: one two-rank group per direction between neighbouring ranks, messages
    matched by order, as NCCL needs (`plait.pipeline.directed`: each rank posts its receives in
    the order its peers send them). ``"auto"``: tagged on Gloo, directed on
    other backends.

    Data parallelism across pipelines (each stage its own DDP or FSDP module, reducing in its
    last backward of the step): build the pipeline with `plait.parallelize` instead.
    """
    if tp_plan is not None or sequence_parallel or mesh.size("tp") > 1:
        raise ValueError(
            "pipeline: tensor parallelism inside the stages is composed by plait.parallelize, which "
            "splits the model and then builds each rank's stages: plait.parallelize(model, mesh, "
            "plait.ParallelPlan(tp=tp_plan, sequence_parallel=..., data='none', pp_schedule=..., "
            "pp_microbatches=..., loss_fn=..., seed=...))")
    if loss_fn is None:
        raise TypeError("pipeline: loss_fn is required: a callable (last stage output, targets) -> scalar")
    parts = split_stages(module, mesh, split=split, schedule=schedule, microbatches=microbatches,
                         chunks=chunks, device=device, p2p=p2p)
    if is_meta(module):
        parts.materialize(seed)
    parts.place(seed, None)
    return Pipeline(parts, microbatches=microbatches, loss_fn=loss_fn)
