"""The layout's side of a check: one rank of the model under `plait.parallelize`, step by step
against what the one-process run wrote (`plait.check.oracle`)."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait._torch_compat import map_tensors, tensors_in
from plait.check.budget import tolerance_of
from plait.check.common import (
    CheckInputError,
    Exchange,
    LossFn,
    Spec,
    as_args,
    build,
    chunk,
    logits_of,
    next_token_loss,
    refuse_routing_in_half,
)
from plait.check.probe import Comparer, module_order
from plait.check.report import (
    CheckReport,
    StepDiff,
    batchnorm_note,
    first_divergence,
    per_rank_batchnorms,
    tensor_diff,
    update_rounding,
)
from plait.compose.parallelize import ParallelPlan, parallelize
from plait.cp import shard as cp_shard
from plait.models.moe import MoE
from plait.pipeline import Pipeline
from plait.runtime import comm
from plait.runtime.env import init
from plait.runtime.mesh import AXES, Mesh
from plait.state.materialize import is_meta
from plait.state.state_dict import full_state_dict
from plait.tp import VocabParallelOutput, loss_fn_for, tp_info

DATA_AXES = ("dp", "fsdp")  # ranks along these see different slices of the batch
LOSS_AXES = ("dp", "fsdp", "cp")  # and along these, different tokens: their losses average to the batch's
State = dict[str, torch.Tensor]


class LayoutRun:
    """This rank's model in the layout, its SGD optimizer and the comparison loop."""

    def __init__(self, spec: Spec, exchange: Exchange, mesh: Mesh | None = None) -> None:
        self.spec, self.exchange = spec, exchange
        self.device = init(seed=spec.seed)
        model, _, user_loss = build(spec)
        refuse_routing_in_half(model, spec)
        if not is_meta(model):
            model.to(self.device)
        d = spec.degrees
        self.mesh = mesh if mesh is not None else Mesh(pp=d["pp"], dp=d["dp"], fsdp=d["fsdp"], tp=d["tp"],
                                                       cp=d["cp"], ep=d["ep"])
        plan = _complete_plan(spec.plan, model, self.mesh, user_loss)
        self.label = _describe(plan, self.mesh)
        # the original names, before any wrapper
        sp = plan.sequence_parallel and self.mesh.size("tp") > 1
        splits = sp or any(self.mesh.size(a) > 1 for a in (*DATA_AXES, "cp", "pp"))
        modules = compared_modules(model, self.mesh.size("pp") > 1, splits)
        self.param_names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
        self.batchnorms = per_rank_batchnorms(model) if splits else []
        tokens, world = spec.batch_size * spec.seq, dist.get_world_size()
        computes_in = spec.plan.precision.param_dtype if spec.plan.precision is not None else spec.dtype
        self.tolerance, self.budget = tolerance_of(spec.tolerance, computes_in, model, tokens, world)
        self.layout = parallelize(model, self.mesh, plan)
        self.loss = _layout_loss(self.layout, user_loss)
        self.opt = torch.optim.SGD(list(self.layout.parameters()), lr=spec.lr)
        cp = (self.mesh.size("cp"), self.mesh.rank("cp"))
        self.comparer = Comparer(modules, dist.get_rank(), cp) if spec.activations else None
        self.data_rank = self.mesh.rank(DATA_AXES)

    def run(self) -> CheckReport:
        s = self.spec
        before, ref_before = full_state_dict(self.layout), self.exchange.get_step(0)["state"]
        missing = sorted(set(before) ^ set(ref_before))
        initial = {k: tensor_diff(before[k], ref_before[k]) for k in ref_before if k in before}
        steps: list[StepDiff] = []
        order: dict[str, int] = {}
        for step in range(1, s.steps + 1):
            diff, before, ref_before, order = self._step(step, before, ref_before, order)
            steps.append(diff)
        if self.comparer is not None:
            self.comparer.remove()
        if not order:  # no outputs compared: modules in the order of their first state entry
            for i, k in enumerate(ref_before):
                order.setdefault(k.rpartition(".")[0], i)
        first = first_divergence(steps, initial, missing, self.tolerance, order)
        tolerances = [self.tolerance(i) for i in range(s.steps + 1)]
        notes = [batchnorm_note(self.batchnorms)] if first is not None and self.batchnorms else []
        return CheckReport(s.label, self.label, str(s.dtype).replace("torch.", ""), tolerances[-1], s.lr,
                           initial, steps, missing, first, tolerances, self.budget, notes)

    def _step(self, step: int, before: State, ref_before: State,
              order: dict[str, int]) -> tuple[StepDiff, State, State, dict[str, int]]:
        ref = self.exchange.get_step(step)
        n = self.spec.data_size
        x, y = (map_tensors(partial(_slice, device=self.device, n=n, i=self.data_rank), ref[k])
                for k in ("inputs", "targets"))
        seq = next((t.shape[1] for t in tensors_in(x) if t.dim() > 1), 0)
        if self.mesh.size("cp") > 1:  # this rank's tokens of every sequence, as plait train feeds them
            x, y = (map_tensors(self._tokens, t) for t in (x, y))
        if self.comparer is not None:
            outputs = self.exchange.get_slice(step, self.data_rank)["outputs"]
            order = order or module_order(outputs)
            self.comparer.compare_with(outputs, seq)
        self.opt.zero_grad(set_to_none=True)
        with comm.scope(f"check step {step}"):  # named in desync reports and timeouts
            loss, loss_eps = self._forward_backward(x, y)
        if self.comparer is not None:
            self.comparer.stop()
        self.opt.step()
        after, ref_after, lr = full_state_dict(self.layout), ref["state"], self.spec.lr
        # Plain SGD: what reached the optimizer is (before - after) / lr, in every layout alike.
        grads = {k: tensor_diff((before[k].double() - after[k].double()) / lr,
                                (ref_before[k].double() - ref_after[k].double()) / lr,
                                update_rounding(ref_before[k], lr))
                 for k in self.param_names if k in after and k in ref_after}
        params = {k: tensor_diff(after[k], ref_after[k]) for k in ref_after if k in after}
        ref_loss = ref["loss"]
        off = max(0.0, abs(loss - ref_loss) - 2 * loss_eps * abs(ref_loss))  # beyond the loss's own rounding
        diff = StepDiff(step, loss, ref_loss, off / max(abs(ref_loss), torch.finfo(self.spec.dtype).eps),
                        grads, params)
        self._gather_outputs(diff, step)  # a collective: every rank has read this step's files by now
        if dist.get_rank() == 0:
            for done in (0, step) if step == 1 else (step,):
                self.exchange.consumed(done)
        return diff, after, ref_after, order

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        """A batch tensor's tokens on this cp rank: dim 1 is the sequence (a tensor of one dim has none)."""
        return cp_shard(t, self.mesh) if t.dim() > 1 else t

    def _forward_backward(self, x: Any, y: Any) -> tuple[float, float]:
        """This rank's slice forward and backward; returns the loss averaged over the data and cp ranks and
        the epsilon of the coarser of the model's dtype and the loss's (a pipeline reports its loss
        in float64 whatever the model computed it in)."""
        if isinstance(self.layout, Pipeline):
            loss = self.layout.step(x, y)
        else:
            loss = self.loss(self.layout(*as_args(x)), y)
            loss.backward()
        group = self.mesh.group(LOSS_AXES)  # cp ranks' equal shares of the tokens: the mean of means
        t = torch.tensor([float(loss.detach())], dtype=torch.float64, device=comm.device_of(group))
        comm.all_reduce(t, group)
        eps = max(torch.finfo(loss.dtype).eps, torch.finfo(self.spec.dtype).eps)
        return float(t) / self.mesh.size(LOSS_AXES), eps

    def _gather_outputs(self, diff: StepDiff, step: int) -> None:
        """Every rank's findings: how many outputs it compared, its worst, its earliest past tolerance."""
        mine: tuple[int, Any, Any] = (0, None, None)
        if self.comparer is not None:
            ds, tol = self.comparer.diffs, self.tolerance(step)
            mine = (len(ds), max(ds, key=lambda d: _nan_high(d.rel), default=None),
                    min((d for d in ds if not d.rel <= tol), key=lambda d: (d.order, d.rank), default=None))
        found = comm.all_gather_object(mine)
        diff.compared = sum(c for c, _, _ in found)
        diff.worst = max((w for _, w, _ in found if w is not None), key=lambda d: _nan_high(d.rel),
                         default=None)
        diff.first = min((f for _, _, f in found if f is not None), key=lambda d: (d.order, d.rank),
                         default=None)


def compared_modules(model: nn.Module, pipelined: bool, tokens_split: bool) -> list[tuple[str, nn.Module]]:
    """The modules whose outputs the layout's ranks compare with one process's. ``tokens_split``:
    a call on a rank sees part of one process's tokens (data ranks, cp, sequence parallelism, a
    pipeline's microbatches)."""
    modules = list(model.named_modules())
    if pipelined:
        # Parameter-free modules (dropout, rotary tables, the glue of the model's forward) run on
        # every stage, on what that stage received or on zeros: only the owners of weights count.
        modules = [(n, m) for n, m in modules if n and any(True for _ in m.parameters())]
    if tokens_split:
        # An expert's rows are the tokens routed to it, not a batch or a sequence: a rank's are
        # not a slice of one process's, even where their count happens to equal one process's.
        experts = tuple(f"{n}.experts" if n else "experts" for n, m in modules if isinstance(m, MoE))
        if experts:
            modules = [(n, m) for n, m in modules if not n.startswith(experts)]
    return modules


def _slice(t: torch.Tensor, device: torch.device, n: int, i: int) -> torch.Tensor:
    return chunk(t, n, i).to(device)


def _nan_high(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _complete_plan(plan: ParallelPlan, model: nn.Module, mesh: Mesh,
                   user_loss: LossFn | None) -> ParallelPlan:
    """The plan with what the check fills in: tp styles for plait's GPT, and a pipeline's loss."""
    if mesh.size("tp") > 1 and plan.tp is None:
        plan = dataclasses.replace(plan, tp=tp_styles(model, mesh.size("tp"), user_loss is None))
    if mesh.size("pp") > 1 and plan.loss_fn is None:
        styles = (plan.tp or {}).values()
        sharded = any(isinstance(s, VocabParallelOutput) and not s.gather_output for s in styles)
        if user_loss is not None or not sharded:  # sharded logits: the pipeline's vocab-parallel loss
            plan = dataclasses.replace(plan, loss_fn=user_loss or next_token_loss)
    return plan


def tp_styles(model: nn.Module, tp: int, default_loss: bool) -> dict[str, Any]:
    """The built-in plan of the model (`plait.plan_for`) as `plait train` builds it: plait's GPT
    under the default loss keeps its logits split by vocabulary for the vocabulary-parallel loss
    (which the check then covers); other models and losses get the full logits, in the check's
    dtype, as in the one-process run."""
    from plait.plans import plan_for, splits_logits_by_default

    try:
        return plan_for(model, loss_parallel=default_loss and splits_logits_by_default(model))
    except (ValueError, TypeError) as e:
        raise CheckInputError(f"tp={tp}: no built-in tensor-parallel plan fits {type(model).__name__} ({e}); "
                              "pass plan=plait.ParallelPlan(tp={module pattern: style})") from None


def _layout_loss(layout: nn.Module | Pipeline, user_loss: LossFn | None) -> LossFn:
    if user_loss is not None or isinstance(layout, Pipeline):
        return user_loss or next_token_loss
    info = tp_info(layout)
    if info is None or info.vocab_size is None:
        return next_token_loss
    return partial(_vocab_parallel_loss, loss_fn_for(layout))  # the plan leaves the logits split


def _vocab_parallel_loss(loss: LossFn, output: Any, targets: torch.Tensor) -> torch.Tensor:
    return loss(logits_of(output), targets)


def _describe(plan: ParallelPlan, mesh: Mesh) -> str:
    sizes = [(a, mesh.size(a)) for a in AXES] + [("ep", mesh.ep)]
    degrees = ", ".join(f"{a}={n}" for a, n in sizes if n > 1) or "one rank"
    data = {"ddp": "DDP", "fsdp": f"FSDP (ZeRO-{plan.zero_stage})", "none": "no data parallelism"}
    parts = [data[plan.data]]
    if mesh.size("tp") > 1:
        parts.append("tensor parallel" + (" + sequence parallel" if plan.sequence_parallel else ""))
    if mesh.size("cp") > 1:
        parts.append(f"context parallel ({plan.cp})")
    if mesh.ep > 1:
        parts.append("expert parallel")
    if mesh.size("pp") > 1:
        parts.append(f"pipeline {plan.pp_schedule} x {plan.pp_microbatches} microbatches")
    if plan.mixed_precision:
        parts.append(f"{plan.mixed_precision} compute")
    if plan.ac is not None:
        every = f", every {plan.ac_every} blocks" if plan.ac_every > 1 else ""
        parts.append(f"{plan.ac} activation checkpointing{every}")
    return f"{', '.join(parts)} on {degrees} ({mesh.world_size} ranks)"
