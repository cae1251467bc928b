"""The pipeline executor: runs one rank's action list with point-to-point sends and receives.

Every stage is called as ``stage(*microbatch_inputs, *received)`` (the first stage receives
nothing; see `plait.pipeline.replay`). What moves between neighbouring stages (rank ``s % p`` to
rank ``(s + 1) % p`` on the ``pp`` axis): in forward, every tensor of the tuple the stage returns;
in backward, the gradient of every one of them that requires one. Shapes and dtypes are exchanged
once per input signature by a metadata pass along the stages, so no shape specs are needed. All
receives of a step are posted when it starts (tags are unique per stage, microbatch and tensor,
so arrival order does not matter); sends are waited for at the end. That needs a backend that
matches messages by tag (Gloo). The *directed* mode (NCCL) sends each message on a process group
of its own direction (one per ordered pair of neighbouring ranks, see `plait.pipeline.directed`):
NCCL ignores tags and runs a communicator's operations in order on one stream, so with one
communicator per direction a receive is matched by order alone, and traffic in the two directions
never queues behind each other.

Data parallelism of wrapped stages (DDP or FSDP, handed in by `plait.parallelize`): gradients
accumulate locally over the step's microbatches, and only each stage's last accumulating
backward of the step (its m-th BW, or with split backward its m-th W, counted as they run)
reduces them, so the all-reduces or reduce-scatters its hooks start overlap that backward.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from plait.pipeline.actions import Action, Kind, Slot
from plait.pipeline.backward_split import WeightGrad, backward_input
from plait.pipeline.schedules import Schedule
from plait.runtime import comm, faults

Meta = list[tuple[tuple[int, ...], torch.dtype, bool]]  # per carried tensor: shape, dtype, needs grad
Key = tuple[int, int]  # (stage, microbatch)
# (stage, reduce) -> the context a stage's action runs in: reduce=True for the stage's last
# accumulating backward of the step, False for everything else (gradients accumulate locally).
GradSync = Callable[[int, bool], AbstractContextManager[None]]


class MetaCarry(Protocol):
    """What travels with the metadata pass besides the shapes of the tensors a stage sends: the
    real shapes of every earlier layer output, for the stand-ins' placeholders (`plait.pipeline.replay`)."""

    def carried(self, stage: int) -> Any:
        """What this rank passes on after running ``stage``."""
        ...

    def receive(self, carried: Any) -> None:
        """Take what the previous stage's rank passed on."""
        ...


def as_tuple(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    out = x if isinstance(x, tuple) else (x,)
    for t in out:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pipeline: {what} must be a tensor or a tuple of tensors, "
                            f"found {type(t).__name__}")
    return out


def describe(xs: Sequence[torch.Tensor]) -> Meta:
    return [(tuple(t.shape), t.dtype, bool(t.requires_grad)) for t in xs]


class Executor:
    """Runs schedules for the stages this rank holds. Owned by `plait.pipeline.Pipeline`."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module], rank: int, pp_ranks: list[int],
                 group: dist.ProcessGroup, loss_fn: Callable[..., torch.Tensor], device: torch.device,
                 links: dict[tuple[int, int], dist.ProcessGroup] | None = None, fill_w: bool = True,
                 params: dict[int, list[torch.Tensor]] | None = None,
                 grad_sync: GradSync | None = None, carry: MetaCarry | None = None) -> None:
        self.sched, self.stages, self.rank, self.fill_w = schedule, stages, rank, fill_w
        self.carry = carry
        # (sender, receiver) global ranks -> the process group carrying that direction; None:
        # every message on the default group, told apart by tag.
        self.links = links
        self.pp_ranks, self.group, self.loss_fn, self.device = pp_ranks, group, loss_fn, device
        # Per stage, the autograd leaves its forward uses (a wrapper's, e.g. FSDP's unsharded views).
        self.params = params if params is not None else {
            s: [p for p in st.parameters() if p.requires_grad] for s, st in stages.items()}
        self.grad_sync = grad_sync
        self.reduce_grads = True  # False: no backward of a step reduces (the pipeline's no_sync)
        self.loss_scale: float | None = None  # multiplies the loss before backward (fp16 loss scaling)
        # signature -> {stage: input metadata, -1 - stage: output metadata}
        self.in_meta: dict[Any, dict[int, Meta]] = {}
        self.timeline: list[Slot] = []
        self.t0 = 0.0  # perf_counter() when the last step started
        self.step_time = 0.0  # seconds from t0 until this rank's actions (and sends) finished
        # id(schedule) -> (schedule, this rank's receives in send order): worked out once, not per step.
        self._posting: dict[int, tuple[Schedule, list[Action]]] = {}

    def receive_order(self, sched: Schedule) -> list[Action]:
        """This rank's receives of ``sched`` in the order their senders send them (cached)."""
        held = self._posting.get(id(sched))
        if held is None or held[0] is not sched:
            held = self._posting[id(sched)] = (sched, sched.receive_order(self.rank))
        return held[1]

    def sync(self, stage: int, reduce: bool) -> AbstractContextManager[None]:
        """The context of one action on ``stage`` (see `GradSync`); nothing for unwrapped stages."""
        if self.grad_sync is None:
            return contextlib.nullcontext()
        return self.grad_sync(stage, reduce and self.reduce_grads)

    # ------------------------------------------------------------------ metadata pass
    def exchange_meta(self, key: Any, example: tuple[torch.Tensor, ...]) -> dict[int, Meta]:
        """Run each of this rank's stages once on ``example`` inputs and received zeros, in stage
        order, passing the shapes of what they send along.

        The chain visits ranks in stage order, so the blocking object sends cannot deadlock.
        The RNG state is restored so that dropout draws match a run without this pass.
        """
        if key in self.in_meta:
            return self.in_meta[key]
        metas: dict[int, Meta] = {}
        local: Meta = []  # the output metadata of the stage just run (on this rank)
        S = self.sched.stages
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            inputs = tuple(t.to(self.device) for t in example)
            for s in sorted(self.stages):
                meta: Meta = []
                if s > 0 and self.sched.stage_rank(s - 1) == self.rank:
                    meta = local
                elif s > 0:
                    meta, carried = comm.recv_object(self.peer(s - 1), self.group)
                    if self.carry is not None:
                        self.carry.receive(carried)
                x = tuple(torch.zeros(sh, dtype=dt, device=self.device).requires_grad_(rg)
                          for sh, dt, rg in meta)
                metas[s] = meta
                if s == S - 1:
                    continue
                with torch.enable_grad(), self.sync(s, False), _uncounted(self.stages[s]):
                    out = as_tuple(self.stages[s](*inputs, *x), f"the output of stage {s}")
                local = describe(out)
                metas[-1 - s] = local  # output metadata under a negative key: -1 - stage
                if self.sched.stage_rank(s + 1) != self.rank:
                    carried = None if self.carry is None else self.carry.carried(s)
                    comm.send_object((local, carried), self.peer(s + 1), self.group)
        self.in_meta[key] = metas
        return metas

    def peer(self, stage: int) -> int:
        return self.pp_ranks[self.sched.stage_rank(stage)]

    def tag(self, grad: bool, boundary: int, mb: int, i: int) -> int:
        if self.links is not None:
            # One group per direction: matched by order alone, as on NCCL (which ignores tags), so
            # runs on Gloo exercise the same matching.
            return i
        return ((int(grad) * self.sched.stages + boundary) * self.sched.microbatches + mb) * 64 + i

    # ------------------------------------------------------------------ one step
    def run(self, sched: Schedule, metas: dict[int, Meta], mb_inputs: list[tuple[torch.Tensor, ...]],
            mb_targets: list[Any] | None, train: bool) -> tuple[torch.Tensor | None, list[Any]]:
        """Execute this rank's actions; return (sum of microbatch losses or None, last-stage outputs)."""
        self.t0 = time.perf_counter()
        step = _Step(self, sched, metas, mb_inputs, mb_targets, train)
        step.run()
        self.timeline, self.step_time = step.timeline, time.perf_counter() - self.t0
        return step.loss_sum, step.outputs

    def _recv_into(self, a: Action, metas: dict[int, Meta]) -> tuple[list[torch.Tensor], int, int]:
        """Buffers for receive ``a`` (activations, or the gradients of outputs that need one),
        the sender's global rank and the first tag."""
        if a.kind is Kind.RECV_F:
            bufs = [torch.empty(sh, dtype=dt, device=self.device) for sh, dt, _ in metas[a.stage]]
            mb = a.mb
            if faults.active("pp-recv-order") and a.mb ^ 1 < self.sched.microbatches:  # a bug in tests only
                mb = a.mb ^ 1
            return bufs, self.peer(a.stage - 1), self.tag(False, a.stage - 1, mb, 0)
        bufs = [torch.empty(sh, dtype=dt, device=self.device) for sh, dt, rg in metas[-1 - a.stage] if rg]
        return bufs, self.peer(a.stage + 1), self.tag(True, a.stage, a.mb, 0)

    def _send_to(self, a: Action) -> tuple[int, int]:
        """Receiver's global rank and first tag of send ``a``."""
        if a.kind is Kind.SEND_F:
            return self.peer(a.stage + 1), self.tag(False, a.stage, a.mb, 0)
        return self.peer(a.stage - 1), self.tag(True, a.stage - 1, a.mb, 0)

    def _link(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The process group carrying messages from global rank ``src`` to ``dst`` (None: default)."""
        return None if self.links is None else self.links[(src, dst)]

    def _send(self, data: Sequence[torch.Tensor], dst: int,
              tag: int) -> list[tuple[comm.Handle, torch.Tensor]]:
        # Keep each sent buffer referenced until its handle is waited: Gloo reads it asynchronously.
        bufs = [t.contiguous() for t in data]
        via = self._link(self.pp_ranks[self.rank], dst)
        return [(comm.isend(b, dst, self.group, tag + i, via), b) for i, b in enumerate(bufs)]



class _Step:
    """One step's state on this rank: what each action leaves for the next ones.

    Keys are (stage, microbatch). Receives are all posted at the start; a helper thread waits
    for them when W's may fill the waits (see `plait.pipeline.schedules`).
    """

    def __init__(self, ex: Executor, sched: Schedule, metas: dict[int, Meta],
                 mb_inputs: list[tuple[torch.Tensor, ...]], mb_targets: list[Any] | None,
                 train: bool) -> None:
        self.ex, self.sched, self.metas, self.train = ex, sched, metas, train
        self.mb_inputs, self.mb_targets = mb_inputs, mb_targets
        self.row = sched.actions[ex.rank]
        self.timeline: list[Slot] = []
        self.recvs: dict[tuple[Kind, int, int], tuple[list[torch.Tensor], list[comm.Handle]]] = {}
        self.acts_in: dict[Key, tuple[torch.Tensor, ...]] = {}  # stage inputs (leaves)
        self.acts_out: dict[Key, tuple[torch.Tensor, ...]] = {}  # stage outputs (graph roots)
        self.grads_out: dict[Key, list[torch.Tensor]] = {}  # gradients w.r.t. stage outputs
        self.grads_in: dict[Key, list[torch.Tensor]] = {}  # gradients w.r.t. stage inputs
        self.pending_w: dict[Key, WeightGrad] = {}
        self.pulled: set[Key] = set()  # W's run early, while waiting for a receive
        self.to_send: dict[Key, tuple[torch.Tensor, ...]] = {}  # activations awaiting SEND_F
        self.sends: list[tuple[comm.Handle, torch.Tensor]] = []
        self.accumulated = dict.fromkeys(ex.stages, 0)  # BW's / W's run per stage this step
        self.loss_sum: torch.Tensor | None = None
        self.outputs: list[Any] = []
        self.w_order = [(a.stage, a.mb) for a in self.row if a.kind is Kind.W]

    def run(self) -> None:
        # Post every receive now, in the order the peers send (what NCCL's matching by order needs);
        # waiting happens at the action, in list order.
        for a in self.ex.receive_order(self.sched):
            self._post_recv(a)
        # With W's in the plan, a helper thread waits for the receives so that this thread can see
        # whether one has arrived and run a pending W instead of idling (see schedules.py).
        listed = [(a.kind, a.stage, a.mb) for a in self.row if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        arrivals = _Arrivals(self.recvs, listed) if self.w_order and self.ex.fill_w else None
        handlers = {Kind.F: self._forward, Kind.SEND_F: self._send, Kind.SEND_B: self._send,
                    Kind.RECV_F: lambda a: self._recv(a, arrivals),
                    Kind.RECV_B: lambda a: self._recv(a, arrivals),
                    Kind.BW: self._backward, Kind.B: self._backward, Kind.W: self._weight}
        for a in self.row:
            if arrivals is not None and a.kind in (Kind.RECV_F, Kind.RECV_B):
                self._fill_wait(arrivals, (a.kind, a.stage, a.mb))
            elif a.kind is Kind.W and (a.stage, a.mb) in self.pulled:
                continue
            start = time.perf_counter()
            handlers[a.kind](a)
            self.timeline.append(Slot(a, start - self.ex.t0, time.perf_counter() - self.ex.t0))
        for h, _ in self.sends:
            h.wait()
        if arrivals is not None:
            arrivals.join()

    def _post_recv(self, a: Action) -> None:
        ex = self.ex
        bufs, src, tag = ex._recv_into(a, self.metas)
        via = ex._link(src, ex.pp_ranks[ex.rank])
        self.recvs[(a.kind, a.stage, a.mb)] = (
            bufs, [comm.irecv(b, src, ex.group, tag + i, via) for i, b in enumerate(bufs)])

    def _fill_wait(self, arrivals: _Arrivals, key: tuple[Kind, int, int]) -> None:
        """Run pending W's, oldest first, until the receive ``key`` has arrived."""
        while not arrivals.arrived(key):
            early = next((k for k in self.w_order if k in self.pending_w), None)
            if early is None:
                return
            start = time.perf_counter()
            self._run_w(early)
            self.pulled.add(early)
            self.timeline.append(Slot(Action(Kind.W, *early), start - self.ex.t0,
                                      time.perf_counter() - self.ex.t0))

    def _forward(self, a: Action) -> None:
        key, S, ex = (a.stage, a.mb), self.sched.stages, self.ex
        x: tuple[torch.Tensor, ...] = ()
        if a.stage > 0:
            x = tuple(t.requires_grad_(rg and self.train)
                      for t, (_, _, rg) in zip(self.acts_in.pop(key), self.metas[a.stage]))
        with torch.set_grad_enabled(self.train), ex.sync(a.stage, False):
            out = ex.stages[a.stage](*self.mb_inputs[a.mb], *x)
        if a.stage == S - 1:
            if self.mb_targets is None:  # forward only: the model's output, whatever its type
                self.outputs.append(out)
                return
            loss = ex.loss_fn(out, self.mb_targets[a.mb])
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
            out = loss / self.sched.microbatches  # mean over microbatches: the batch's mean loss
            if ex.loss_scale is not None:  # backward runs on the scaled loss; loss_sum stays unscaled
                out = out * ex.loss_scale
        out_t = as_tuple(out, f"the output of stage {a.stage}")
        if self.train:
            self.acts_in[key] = x
            self.acts_out[key] = out_t
        if a.stage < S - 1:
            handoff = tuple(t.detach() for t in out_t)
            if self.sched.stage_rank(a.stage + 1) == ex.rank:
                self.acts_in[(a.stage + 1, a.mb)] = handoff
            else:
                self.to_send[key] = handoff

    def _send(self, a: Action) -> None:
        key = (a.stage, a.mb)
        data = self.to_send.pop(key) if a.kind is Kind.SEND_F else self.grads_in.pop(key)
        self.sends += self.ex._send(data, *self.ex._send_to(a))

    def _recv(self, a: Action, arrivals: _Arrivals | None) -> None:
        bufs, hs = self.recvs.pop((a.kind, a.stage, a.mb))
        if arrivals is not None:
            arrivals.wait((a.kind, a.stage, a.mb))
        else:
            for h in hs:
                h.wait()
        if a.kind is Kind.RECV_F:
            self.acts_in[(a.stage, a.mb)] = tuple(bufs)
        else:
            self.grads_out[(a.stage, a.mb)] = bufs

    def _backward(self, a: Action) -> None:
        """BW (input and weight gradients) or B (input gradients only, W deferred)."""
        key, ex = (a.stage, a.mb), self.ex
        ins = [t for t in self.acts_in.pop(key) if t.requires_grad]
        outs = [t for t in self.acts_out.pop(key) if t.requires_grad]
        # The last stage's output is the loss (gradient implied); the others' were received or handed over.
        g: Sequence[torch.Tensor | None] = (self.grads_out.pop(key) if a.stage < self.sched.stages - 1
                                            else [None] * len(outs))
        if not outs:  # nothing this stage sent depends on a gradient: nothing to run
            gin = [torch.zeros_like(t) for t in ins]
            if a.kind is Kind.B:
                self.pending_w[key] = WeightGrad([], [], [], [])
        elif a.kind is Kind.BW:
            with ex.sync(a.stage, self._accumulates(a.stage)):
                torch.autograd.backward(outs, g, inputs=[*ins, *ex.params[a.stage]] or None)
            gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
        else:  # B accumulates no parameter gradient: never the reducing backward
            with ex.sync(a.stage, False):
                got, self.pending_w[key] = backward_input(outs, g, ins, ex.params[a.stage])
            gin = [t if t is not None else torch.zeros_like(x) for t, x in zip(got, ins)]
        if a.stage > 0:
            if self.sched.stage_rank(a.stage - 1) == ex.rank:
                self.grads_out[(a.stage - 1, a.mb)] = gin
            else:
                self.grads_in[key] = gin

    def _weight(self, a: Action) -> None:
        self._run_w((a.stage, a.mb))

    def _run_w(self, key: Key) -> None:
        with self.ex.sync(key[0], self._accumulates(key[0])):
            self.pending_w.pop(key).run()

    def _accumulates(self, stage: int) -> bool:
        """Count one accumulating backward of ``stage``; True for its last of the step, whichever
        microbatch that is (pulled W's change the order)."""
        self.accumulated[stage] += 1
        return self.accumulated[stage] == self.sched.microbatches


class _Arrivals:
    """Waits for a step's receives on a helper thread, in the order the action list waits for them.

    Gloo's ``Work.is_completed()`` turns true only once someone waited on the work, so the main
    thread cannot poll a receive itself. The helper blocks in ``wait()`` (which releases the GIL)
    and sets one event per receive; a failure (e.g. a timeout) is re-raised by `wait` on the main
    thread, naming the receive.
    """

    def __init__(self, recvs: dict[Any, tuple[list[torch.Tensor], list[comm.Handle]]],
                 keys: list[Any]) -> None:
        self._events = {k: threading.Event() for k in recvs}
        self._error: BaseException | None = None
        # In the order the actions need them (not the posting order, which goes sender by sender: a
        # message from one peer that depends on this rank's progress must not hold up another's).
        order = [(k, recvs[k][1]) for k in keys]
        self._thread = threading.Thread(target=self._run, args=(order,), daemon=True,
                                        name="plait-pipeline-recv")
        self._thread.start()

    def _run(self, order: list[tuple[Any, list[comm.Handle]]]) -> None:
        try:
            for k, hs in order:
                for h in hs:
                    h.wait()
                self._events[k].set()
        except BaseException as e:  # handed to the main thread
            self._error = e
            for ev in self._events.values():
                ev.set()

    def arrived(self, key: Any) -> bool:
        return self._events[key].is_set()

    def wait(self, key: Any) -> None:
        self._events[key].wait()
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def busy_fraction(timeline: Sequence[Slot], total: float) -> float:
    busy = sum(s.end - s.start for s in timeline if s.action.kind.is_compute)
    return busy / total if total > 0 else 0.0


@contextlib.contextmanager
def _uncounted(stage: nn.Module) -> Iterator[None]:
    """The metadata forward is never backpropagated: modules that count their training forwards
    (``counts_forwards``: the MoE balancing statistics) leave it out."""
    counting = [m for m in stage.modules() if getattr(m, "counts_forwards", False)]
    for m in counting:
        m.counts_forwards = False  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in counting:
            m.counts_forwards = True  # type: ignore[assignment]
