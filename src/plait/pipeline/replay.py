"""Pipeline stages that run the model's unchanged forward, so any model can be pipelined.

Every stage calls the model's own top-level ``forward`` on the microbatch's inputs, through a
*shell*: a shallow copy of the model's module tree down to the segments (the parent modules, whose
forwards are glue: Llama's ``LlamaForCausalLM`` and ``model``, GPT-2's ``transformer``), in which

* the producer segments (those with parameters) this stage owns are the real modules
  (materialized, tensor-parallel, wrapped);
* parameter-free segments (rotary tables, dropout) are the real modules, run on every stage: they
  are glue, like the position ids and masks the parents' forwards compute;
* every other producer is a *stand-in*: a shallow copy of its meta-device skeleton (so the parent
  code finds the attributes and types it expects) whose forward returns, for each tensor of the
  real module's output, the value received from the previous stage when this stage or a later one
  needs it (`plait.pipeline.flow` finds which), and otherwise zeros of the shape and dtype the
  real module gives (passed along the metadata pass: tensor parallelism, sequence parallelism and
  mixed precision change them), shared by all stand-ins of one forward.

A stage other than the last stops the forward (a private exception that ``except Exception`` does
not catch) when it reaches the stand-in of a later stage's producer after all of its own have run
(not from a hook of its last module: the hooks tensor parallelism and FSDP put there must run
first), and returns what the next stage receives: its own producers' outputs and the received
values it relays. The last stage runs the forward to its end and returns exactly what the model returns (a
``ModelOutput`` too), which ``loss_fn`` receives. This is torchtitan's approach (each stage runs
the model's forward with the layers it does not own removed), without editing the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from plait._torch_compat import tree_flatten, tree_unflatten
from plait.pipeline.flow import Flow, Key, StagePlan, TensorLeaf, Tracer
from plait.pipeline.split import Segment, meta_copy, place
from plait.runtime.env import get_logger


class _Stop(BaseException):
    """Raised by a stand-in to end a non-last stage's forward; caught in `ReplayStage.forward`."""


def _copy_tree(mod: nn.Module, prefix: str, slots: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``mod`` whose child modules are ``slots[name]`` for segments and copies
    of this kind for the modules above segments (attributes such as configs are shared)."""
    new = copy.copy(mod)
    children: dict[str, nn.Module | None] = {}
    for name, child in mod._modules.items():
        full = prefix + name
        if full in slots:
            children[name] = slots[full]
        elif child is not None and any(k.startswith(full + ".") for k in slots):
            children[name] = _copy_tree(child, full + ".", slots)
        else:
            children[name] = child
    new.__dict__["_modules"] = children
    return new


class Replay:
    """What the stages of one pipeline share: the segments and the stage of each, a meta-device
    skeleton of the model as given, and the dataflow of each input signature (`prepare`)."""

    def __init__(self, module: nn.Module, segs: Sequence[Segment], plan: Sequence[Sequence[int]],
                 device: torch.device) -> None:
        self.root, self.device = module, device
        self.names = [n for n, _ in segs]
        self.modules = [m for _, m in segs]
        self.owner = [0] * len(segs)
        for s, idx in enumerate(plan):
            for i in idx:
                self.owner[i] = s
        self.stages = len(plan)
        self.producers = {i for i, m in enumerate(self.modules) if next(m.parameters(), None) is not None}
        # Taken before any stage is materialized, sharded or wrapped: the probes of the dataflow trace and
        # the stand-ins run or mimic these modules, never the real ones.
        self.skeleton = meta_copy(module)
        self._cache: dict[Any, tuple[Flow, list[StagePlan]]] = {}
        self.flow: Flow | None = None
        self.plans: list[StagePlan] = []

    def glue(self) -> list[Segment]:
        """The parameter-free segments, which every stage runs itself."""
        return [(n, m) for i, (n, m) in enumerate(zip(self.names, self.modules)) if i not in self.producers]

    def shell(self, slot: Callable[[int], nn.Module]) -> nn.Module:
        """The model's tree with producer ``i`` replaced by ``slot(i)`` and glue segments kept."""
        slots = {n: slot(i) if i in self.producers else self.modules[i] for i, n in enumerate(self.names)}
        return _copy_tree(self.root, "", slots)

    def stand_in(self, i: int, forward: Callable[..., Any]) -> nn.Module:
        """A shallow copy of segment ``i``'s skeleton whose forward is ``forward``."""
        sub = copy.copy(self.skeleton.get_submodule(self.names[i]))
        sub.__dict__["forward"] = forward  # shadows the class's forward, on this copy only
        return sub

    def prepare(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Make the dataflow of ``inputs``' signature current (a dataflow trace the first time it is seen)."""
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if key not in self._cache:
            self._cache[key] = self._trace(inputs)
        self.flow, self.plans = self._cache[key]

    # The `plait.pipeline.runtime.MetaCarry` protocol: real output shapes travel with the metadata
    # pass, so placeholders match what tensor parallelism, sequence parallelism or mixed precision make.
    def carried(self, stage: int) -> dict[Key, TensorLeaf]:
        assert self.flow is not None
        return {k: v for k, v in self.flow.real.items() if self.owner[k[0]] <= stage}

    def receive(self, carried: dict[Key, TensorLeaf]) -> None:
        assert self.flow is not None
        self.flow.real.update(carried)

    def _trace(self, inputs: tuple[torch.Tensor, ...]) -> tuple[Flow, list[StagePlan]]:
        tracer = Tracer(self.device)
        skel = {i: self.skeleton.get_submodule(self.names[i]) for i in self.producers}
        shell = self.shell(lambda i: self.stand_in(i, tracer.probe(i, skel[i])))
        try:
            flow = tracer.run(shell, inputs)
        except Exception as e:
            # A layer whose forward depends on its data's values (torch.nonzero, .item(), a boolean
            # mask: transformers' MoE dispatch) has no meta-device result to trace.
            dependent = isinstance(e, NotImplementedError)
            advice = ("; a layer whose forward depends on the values of its data (such as transformers' "
                      "MoE expert dispatch through torch.nonzero) cannot be traced on the meta device, so "
                      "this model cannot be split into stages: train it without a pipeline (data "
                      "parallelism, FSDP or tensor parallelism)") if dependent else ""
            raise RuntimeError(f"pipeline: the dataflow trace of {type(self.root).__name__}.forward "
                               "(layers on the meta device, glue on the inputs) "
                               f"failed: {type(e).__name__}: {e}"
                               f"{advice}") from e
        log = get_logger()
        unused = [self.names[i] for i in sorted(self.producers) if i not in flow.calls]
        if unused:
            log.warning("pipeline: the forward never calls %s; their parameters get no gradient", unused)
        for what in dict.fromkeys(flow.reads):
            log.warning("pipeline: the forward reads values in Python (%s); stages that do not own "
                        "those segments see zeros there", what)
        return flow, flow.plans(self.owner, self.names)


class _Ctx:
    """One forward of one stage: received values, captured outputs, calls seen so far."""

    def __init__(self, flow: Flow, plan: StagePlan, received: dict[Key, torch.Tensor],
                 device: torch.device) -> None:
        self.flow, self.received, self.device = flow, received, device
        self.wanted = set(plan.send)
        self.captured: dict[Key, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self.pending = sum(plan.calls.values())  # own producer calls still to come
        self._zeros: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def count(self, i: int) -> int:
        c = self.counts.get(i, 0)
        self.counts[i] = c + 1
        return c

    def zeros(self, leaf: TensorLeaf) -> torch.Tensor:
        """A placeholder: no one downstream reads its values, only its shape and dtype (shared)."""
        key = (leaf.shape, leaf.dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(leaf.shape, dtype=leaf.dtype, device=self.device)
        return self._zeros[key]


class ReplayStage(nn.Module):
    """One pipeline stage: the model's forward run with this stage's segments, called as
    ``stage(*model_inputs, *received)``; returns the tuple the next stage receives, or on the last
    stage the model's output.

    The stage's own segments are registered under their names in the original model (``layers.3``),
    so its parameter names are the model's: tensor-parallel plans, FSDP's units and state dicts and
    per-module initialisation see the original names.
    """

    def __init__(self, index: int, replay: Replay, segs: Sequence[Segment]) -> None:
        super().__init__()
        # Attribute names a model's children are unlikely to have: the children live beside them.
        self.stage_index = index
        self.segment_names = [n for n, _ in segs]
        self._owned = tuple(m for _, m in segs)  # a tuple: not registered a second time
        place(self, segs)
        self._replay = replay
        self._last = index == replay.stages - 1
        self._ctx: _Ctx | None = None
        self._armed = False
        # Kept out of the module tree (a tuple), so wrappers, state dicts and `.to()` never see it.
        self._shell = (replay.shell(self._slot),)

    def _slot(self, i: int) -> nn.Module:
        rep = self._replay
        if rep.owner[i] == self.stage_index:
            return rep.modules[i]
        return rep.stand_in(i, partial(self._stand_in, i))

    @property
    def segments(self) -> list[Segment]:
        """(name in the original model, module) of each segment this stage owns, in model order."""
        return list(zip(self.segment_names, self._owned))

    def qualified_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter) for this stage, tied ones once."""
        return list(self.named_parameters())

    def train(self, mode: bool = True) -> ReplayStage:
        super().train(mode)
        self._shell[0].train(mode)  # the parents' forwards and the glue read `training` too
        return self

    def _arm(self) -> None:
        """Capture the own producers' outputs. Registered at the first forward, after tensor
        parallelism's and the data-parallel wrapper's hooks, so it sees what the parent receives."""
        rep = self._replay
        for i in sorted(rep.producers):
            if rep.owner[i] == self.stage_index:
                rep.modules[i].register_forward_hook(partial(self._capture, i))
        self._armed = True

    def forward(self, *args: Any) -> Any:
        rep = self._replay
        if rep.flow is None:
            raise RuntimeError("pipeline: a stage ran before its pipeline prepared the input signature")
        if not self._armed:
            self._arm()
        plan, n = rep.plans[self.stage_index], rep.flow.n_inputs
        inputs, received = args[:n], args[n:]
        if len(received) != len(plan.recv):
            raise RuntimeError(f"pipeline: stage {self.stage_index} expects {len(plan.recv)} received "
                               f"tensors after the {n} model inputs, got {len(received)}")
        ctx = self._ctx = _Ctx(rep.flow, plan, dict(zip(plan.recv, received)), rep.device)
        out = None
        try:
            if self._last or ctx.pending:  # a stage owning no producer only relays
                out = self._shell[0](*inputs)
        except _Stop:
            pass
        finally:
            self._ctx = None
        if self._last:
            return out
        missing = [rep.names[k[0]] for k in plan.send if k not in ctx.captured and k not in ctx.received]
        if missing:
            raise RuntimeError(f"pipeline: stage {self.stage_index} did not compute the outputs of {missing} "
                               "that the dataflow trace said it sends (does the forward's path depend on "
                               "values?)")
        return tuple(ctx.captured[k] if k in ctx.captured else ctx.received[k] for k in plan.send)

    def _stand_in(self, i: int, *args: Any, **kwargs: Any) -> Any:
        ctx, rep = self._ctx, self._replay
        if ctx is None:
            raise RuntimeError(f"pipeline: the stand-in of {rep.names[i]!r} was called outside its stage")
        c = ctx.count(i)
        if not self._last and ctx.pending == 0 and rep.owner[i] > self.stage_index:
            raise _Stop
        calls = ctx.flow.calls.get(i, [])
        if c >= len(calls):
            raise RuntimeError(f"pipeline: {rep.names[i]!r} is called {c + 1} times, but {len(calls)} in the "
                               "dataflow trace of this input signature; forwards whose calls depend on "
                               "values are not supported")
        call, real = calls[c], ctx.flow.real
        leaves = [ctx.received[(i, c, k)] if (i, c, k) in ctx.received
                  else ctx.zeros(real.get((i, c, k), x)) if isinstance(x, TensorLeaf) else x
                  for k, x in enumerate(call.leaves)]
        return tree_unflatten(leaves, call.spec)

    def _capture(self, i: int, _mod: nn.Module, _args: Any, out: Any) -> None:
        ctx = self._ctx
        if ctx is None:  # the module called outside the pipeline
            return
        c = ctx.count(i)
        ctx.pending -= 1
        for k, t in enumerate(tree_flatten(out)[0]):
            if (i, c, k) in ctx.wanted:
                ctx.captured[(i, c, k)] = t
            if isinstance(t, torch.Tensor) and (i, c, k) not in ctx.flow.real:
                ctx.flow.real[(i, c, k)] = TensorLeaf(tuple(t.shape), t.dtype)
