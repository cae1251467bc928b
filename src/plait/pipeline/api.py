"""`plait.pipeline(...)`: split a model into stages, place them on the ``pp`` axis, run schedules."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait import comm
from plait._torch_compat import map_tensors
from plait.materialize import is_meta
from plait.pipeline.directed import check_directed, direction_groups
from plait.pipeline.generators import make_schedule, with_comms
from plait.pipeline.runtime import Executor, as_tuple, busy_fraction
from plait.pipeline.schedules import COMM, Action, Schedule, ScheduleError, Slot
from plait.pipeline.split import (
    Stage,
    check_chain,
    materialize_segments,
    meta_copy,
    named_view,
    plan_stages,
    segments,
)
from plait.pipeline.ties import find_ties, first_owners, sync_grads, tie_groups
from plait.tensor_parallel import assign_styles, loss_fn_for, tensor_parallel
from plait.tp_styles import VocabParallelOutput

if TYPE_CHECKING:
    from plait.clip import GradParts

__all__ = ["Pipeline", "pipeline"]

CustomSchedule = Schedule | Sequence[Sequence[Action]]


class Pipeline:
    """One rank's part of a pipelined model. Build it with `plait.pipeline`.

    ``step(inputs, targets)`` runs forward and backward of the whole batch as ``microbatches``
    microbatches on the schedule, leaves the gradients in ``.grad`` of this rank's parameters and
    returns the batch's mean loss on every rank of the ``pp`` axis. Pass the same ``inputs`` on
    every ``pp`` rank (the first stage reads them, the others take their shape signature);
    ``targets`` are read on the rank holding the last stage.

    A weight shared by stages on different pp ranks (a tied embedding and LM head) is kept as one
    copy per rank, initialised from its first owner; `step` sums the copies' gradients.

    With ``tp_plan`` (pp x tp), this rank's stages are tensor-parallel over ``mesh.group('tp')``:
    see `pipeline`. ``tp_module`` is then the `plait.tensor_parallel` module holding this rank's
    stage modules under their original names (``tp_info``/``loss_fn_for``/`plait.tp_state` accept
    it), else None.
    """

    def __init__(self, module: nn.Module, mesh: Any, *, split: str | Sequence[str] = "auto",
                 schedule: str | CustomSchedule = "1f1b", microbatches: int,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, chunks: int = 1, seed: int = 0,
                 device: torch.device | str | None = None, tp_plan: Mapping[str, Any] | None = None,
                 sequence_parallel: bool = False, p2p: str = "auto") -> None:
        # Every check below runs before the first collective, so bad input never hangs a rank.
        if not isinstance(module, nn.Module):
            raise TypeError(f"pipeline: module must be a torch.nn.Module, got {type(module).__name__}")
        if not (hasattr(mesh, "size") and hasattr(mesh, "group_ranks")):
            raise TypeError(f"pipeline: mesh must be a plait.Mesh, got {type(mesh).__name__}")
        _check_tp(module, mesh, tp_plan, loss_fn)
        if sequence_parallel and tp_plan is None:
            raise ValueError("pipeline: sequence_parallel=True needs a tp_plan (it splits the sequence "
                             "over the tp axis inside tensor-parallel stages)")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"pipeline: loss_fn must be callable (output, target) -> scalar, got {loss_fn!r}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"pipeline: microbatches must be a positive integer, got {microbatches!r}")
        p = mesh.size("pp")
        self.sched = _resolve_schedule(schedule, p, microbatches, chunks)
        self.microbatches, self.loss_fn = microbatches, loss_fn
        backend = torch.distributed.get_backend()
        directed = _resolve_p2p(p2p, backend)
        if directed:  # before any collective: NCCL matches a direction's messages by order
            check_directed(self.sched)
        self.rank = mesh.rank("pp")
        self.group = mesh.group("pp")
        self.pp_ranks = mesh.group_ranks("pp")
        segs = segments(module)
        plan = plan_stages(segs, self.sched.stages, split)
        self.stage_names = [[segs[i][0] for i in idx] for idx in plan]
        ties = find_ties(segs, plan, self.sched)
        if tp_plan is not None and ties:
            shared = [t.names for t in ties]
            raise ValueError(f"pipeline: tp_plan with weights shared across pp ranks ({shared}) is not "
                             "supported; untie them (e.g. GPTConfig(tie_embeddings=False)) or put "
                             "their users on one pp rank with split=")
        owners = first_owners(module)
        mine = self.sched.rank_stages(self.rank)
        meta = is_meta(module)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))
        self.device = torch.device(device)
        # Structure check at the first step, then dropped. Tensor parallelism changes this rank's
        # modules in place (and their forwards communicate), so the check then runs on a copy of
        # the model as given.
        self._skeleton: nn.Module | None = module if tp_plan is None else meta_copy(module)
        self._segs = segs
        my_segs = [segs[i] for s in mine for i in plan[s]]
        self.tp_module: nn.Module | None = None
        if tp_plan is not None:
            # All of this rank's stages in one tensor_parallel call (one TPInfo, ties inside the rank
            # kept), under the original names: plan patterns match and a meta module gets its init
            # values from full_values under its own name, one module at a time, keeping its shard.
            self.tp_module = tensor_parallel(named_view(my_segs), mesh, tp_plan,
                                             sequence_parallel=sequence_parallel,
                                             seed=seed, strict=False)
            if loss_fn is None:
                loss_fn = loss_fn_for(self.tp_module)
            self.loss_fn = loss_fn
        elif meta:  # all of this rank's stages at once, so ties between them stay ties
            materialize_segments(my_segs, seed, self.device, owners)
        self.stages = {s: Stage(s, [segs[i] for i in plan[s]]).to(self.device) for s in mine}
        # Copies of weights shared with another pp rank, with the group that sums their gradients.
        groups = tie_groups(ties, mesh)
        held = {n: p for s in self.stages.values() for n, p in s.qualified_parameters()}
        self._tied = [(next(held[n] for n in tie.names if n in held), g)
                      for tie, g in zip(ties, groups) if g is not None]
        # Each name of a weight tied across pp ranks -> its first owner's (one optimizer state).
        self.tied_names: dict[str, str] = {n: tie.names[0] for tie in ties for n in tie.names}
        self._my_segs = [(n, m) for s in mine for n, m in zip(self.stages[s].names, self.stages[s].segs)]
        # W's pulled into waits (a helper thread watches the receives): on Gloo only, where a
        # receive's wait() returns when the data is there (NCCL's returns at once, ordering streams),
        # and not when W communicates (sequence parallelism), which would desynchronize tp ranks.
        self.exec = Executor(self.sched, self.stages, self.rank, self.pp_ranks, self.group, loss_fn,
                             self.device, links=direction_groups(self.sched, mesh) if directed else None,
                             fill_w=not sequence_parallel and backend == "gloo")
        self._fwd_sched = self.sched.forward_part().validate()
        self.bubble_fraction = 0.0  # idle / step time of this rank in the last step
        self.step_time = 0.0  # seconds, this rank's start of the step to the end of the whole pipeline

    # ------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the original model (tied ones once)."""
        seen: set[int] = set()
        for s in sorted(self.stages):
            for name, prm in self.stages[s].qualified_parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield name, prm

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, prm in self.named_parameters():
            yield prm

    def state_module(self) -> nn.Module:
        """This rank's stages as one module under their names in the original model: its
        ``state_dict()`` has the original keys (checkpoints use it)."""
        return self.tp_module if self.tp_module is not None else named_view(self._my_segs)

    def grad_norm_parts(self) -> GradParts:
        """Stages hold disjoint parameters, so every gradient is summed over pp; tp-sharded ones
        over tp as well (`plait.clip`). Weights tied across pp ranks count once (their first
        owner's copy), as in `named_parameters`."""
        info = self.tp_info
        sharded = set(info.specs) if info is not None else set()
        grads = [(n in sharded, p.grad) for n, p in self.named_parameters() if p.grad is not None]
        if info is None or info.size == 1:
            return {(self.group,): [g for _, g in grads]}
        return {(self.group, info.group): [g for s, g in grads if s],
                (self.group,): [g for s, g in grads if not s]}

    @property
    def tp_info(self) -> Any:
        """The `plait.tensor_parallel.TPInfo` of this rank's stages (None without ``tp_plan``)."""
        return None if self.tp_module is None else self.tp_module._plait_tp

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
    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        """Forward and backward of the whole batch; returns its mean loss on every pp rank."""
        return self._step(self.sched, inputs, targets, train=True)

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any = None) -> Any:
        """Forward only (the schedule's forwards, in order). With ``targets``: the mean loss on every
        pp rank; without: the last stage's outputs (concatenated) on its rank, None elsewhere."""
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
        mb_in = _chunk(inputs, m, "inputs")
        holds_last = (S - 1) in self.stages
        if targets is None and holds_last and train:
            raise ValueError("pipeline.step: targets are required on the rank holding the last stage")
        mb_tg = None if targets is None else _chunk(targets, m, "targets")
        if self._skeleton is not None:
            check_chain(self._skeleton, self._segs, mb_in[0])
            self._skeleton = None
            self._segs = []
        key = tuple((tuple(t.shape), t.dtype) for t in mb_in[0])
        metas = self.exec.exchange_meta(key, mb_in[0])
        mb_in = [tuple(t.to(self.device) for t in x) for x in mb_in] if 0 in self.stages else mb_in
        if mb_tg is not None and holds_last:
            mb_tg = [map_tensors(lambda x: x.to(self.device), t) for t in mb_tg]
        loss_sum, outs = self.exec.run(sched, metas, mb_in, mb_tg if holds_last else None, train)
        if train:
            sync_grads(self._tied)
        if targets is None and not train:
            self._measure(self.exec.step_time)
            if not holds_last:
                return None
            return torch.cat(outs) if isinstance(outs[0], torch.Tensor) else outs
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
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


def _check_tp(module: nn.Module, mesh: Any, tp_plan: Mapping[str, Any] | None, loss_fn: Any) -> None:
    """Check the tensor-parallel arguments and the loss against the plan (no collective)."""
    tp = mesh.size("tp")
    if tp_plan is None:
        if tp > 1:
            raise ValueError(f"pipeline: the mesh has tp={tp} but no tp_plan was given; pass "
                             "tp_plan=plait.gpt_plan(cfg) (or a plan for your model) to shard the stages")
        if loss_fn is None:
            raise TypeError("pipeline: loss_fn is required: a callable (last stage output, targets) "
                            "-> scalar")
        return
    # Against the whole model, so a typo in a pattern is still an error although each rank's
    # stages hold only some of the matched modules.
    assigned = assign_styles(module, tp_plan, strict=True)
    sharded = any(isinstance(s, VocabParallelOutput) and not s.gather_output for s in assigned.values())
    if sharded and loss_fn is not None:
        raise ValueError("pipeline: tp_plan leaves the logits split by vocabulary (VocabParallelOutput("
                         "gather_output=False)), so the loss must be the vocab-parallel cross-entropy: leave "
                         "loss_fn unset (the pipeline then uses it), or gather the logits; got "
                         f"loss_fn={loss_fn!r}")


def _chunk(x: Any, m: int, what: str) -> list:
    if x is None:
        raise ValueError(f"pipeline: {what} must be given (a tensor or tuple of tensors), got None")
    ts = as_tuple(x, what)
    n = ts[0].shape[0] if ts[0].dim() else 0
    for t in ts:
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"pipeline: every tensor of {what} needs the batch as dim 0 of one size; got "
                             f"shapes {[tuple(u.shape) for u in ts]}")
    if n % m:
        raise ValueError(f"pipeline: {what} batch size {n} is not divisible by microbatches={m}")
    parts = [t.chunk(m) for t in ts]
    out = [tuple(p[i] for p in parts) for i in range(m)]
    return out if isinstance(x, tuple) or what == "inputs" else [o[0] for o in out]


P2P_MODES = ("auto", "tagged", "directed")


def _resolve_p2p(p2p: str, backend: str) -> bool:
    """Whether to send on one group per direction (see `plait.pipeline.directed`)."""
    if p2p not in P2P_MODES:
        raise ValueError(f"pipeline: p2p must be one of {P2P_MODES}, got {p2p!r}")
    if p2p == "tagged" and backend != "gloo":
        raise ValueError(f"pipeline: p2p='tagged' matches messages by tag, which only Gloo does; this "
                         f"process group uses {backend!r}: use p2p='directed' (or 'auto')")
    return p2p == "directed" or (p2p == "auto" and backend != "gloo")


def _resolve_schedule(schedule: Any, p: int, m: int, chunks: int) -> Schedule:
    if isinstance(schedule, str):
        return make_schedule(schedule, p, m, chunks)
    if isinstance(schedule, Schedule):
        sched = schedule
    elif isinstance(schedule, Sequence):
        rows = [list(r) for r in schedule]
        stages = 1 + max((a.stage for r in rows for a in r if isinstance(a, Action)), default=0)
        stages = max(p, -(-stages // p) * p)
        has_comm = any(isinstance(a, Action) and a.kind in COMM for r in rows for a in r)
        sched = (Schedule("custom", p, stages, m, tuple(tuple(r) for r in rows)) if has_comm
                 else with_comms("custom", p, stages, m, rows))
    else:
        raise TypeError(f"pipeline: schedule must be a name, a Schedule or per-rank lists of Actions, "
                        f"got {type(schedule).__name__}")
    if sched.ranks != p or sched.microbatches != m:
        raise ScheduleError(f"pipeline: the schedule is for ranks={sched.ranks}, microbatches="
                            f"{sched.microbatches}, but pp={p} and microbatches={m}")
    return sched.validate()


def pipeline(module: nn.Module, mesh: Any, split: str | Sequence[str] = "auto",
             schedule: str | CustomSchedule = "1f1b", microbatches: int = 4,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, chunks: int = 1,
             seed: int = 0, device: torch.device | str | None = None,
             tp_plan: Mapping[str, Any] | None = None, sequence_parallel: bool = False,
             p2p: str = "auto") -> Pipeline:
    """Pipeline ``module`` over the mesh's ``pp`` axis; see `Pipeline`.

    ``split``: ``"auto"`` (balanced by parameter count) or the segment names that start stages
    1.. (e.g. ``["layers.4"]``); ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
    ``"zb-h1"``, a `Schedule` or per-rank action lists; ``chunks``: stages per rank; ``seed``:
    the `plait.init_weights` seed used to materialize a meta-device model.

    ``tp_plan`` (pp x tp, Megatron's layout): a `plait.tensor_parallel` plan, e.g.
    ``plait.gpt_plan(cfg)``. The model is split into stages first, then each rank's stages are
    tensor-parallel over ``mesh.group('tp')``, with the plan's patterns matched against the
    original names (``layers.*.attn.q_proj``). A meta-device model is materialized by tensor
    parallelism one module at a time, each rank keeping its shards (only one module's full
    tensors exist at once). Stage outputs are replicated over tp, so each rank exchanges
    activations with the rank of the same tp coordinate in the next stage (its pp group).
    When the plan leaves the logits split by vocabulary, leave ``loss_fn`` unset: the last
    stage then computes the vocab-parallel cross-entropy, the same value on each of its tp
    ranks (without a vocab-split head, ``loss_fn`` defaults to `plait.loss_fn_for`'s choice).
    ``sequence_parallel`` (with ``tp_plan``): Megatron's sequence parallelism inside the stages;
    the activations between stages are then split by sequence over tp, each rank exchanging
    its part with its own pp group. Weight gradients of sequence-split norms are summed over tp
    inside W, so W's run exactly where the list puts them (not pulled into waits), keeping the
    tp ranks' collectives in the same order. Not supported with ``tp_plan``: weights tied
    across pp ranks.

    ``p2p``: how stages exchange data. Either way every receive of a step is posted when it
    starts. ``"tagged"``: all messages on the default group, matched by tag (Gloo).
    ``"directed"``: one two-rank group per direction between neighbouring ranks, messages
    matched by order, as NCCL needs (`plait.pipeline.directed`; a schedule whose receives come
    in another order than its sends is refused first). ``"auto"``: tagged on Gloo, directed on
    other backends.
    """
    return Pipeline(module, mesh, split=split, schedule=schedule, microbatches=microbatches,
                    loss_fn=loss_fn, chunks=chunks, seed=seed, device=device, tp_plan=tp_plan,
                    sequence_parallel=sequence_parallel, p2p=p2p)
