"""The one-process side of a check: the model alone, in a process of its own.

It runs in its own process (a world of one, as ``plait train --strategy none`` would), not on one
of the layout's ranks: there a model that reads ``torch.distributed.get_rank()`` would compute
the one-process run differently on each rank, and the comparison would miss exactly the
rank-dependent code it should find. Per step it writes the global batch, the loss, the state
after the SGD step and, for each data-parallel slice of the batch, every module's output on it
(`plait.check.common.Exchange`).
"""

from __future__ import annotations

import pickle
import signal
import sys
import traceback
from functools import partial
from typing import Any

import torch
from torch import nn

from plait._torch_compat import map_tensors, tensors_in
from plait.check.common import (
    BatchFn,
    CheckInputError,
    Exchange,
    Spec,
    as_args,
    build,
    chunk,
    next_token_loss,
)
from plait.check.probe import Recorder
from plait.runtime.env import die_with_parent, init
from plait.state.materialize import is_meta, keep_whole, materialize
from plait.state.precision import mixed_precision


def main() -> None:
    """Entry point of the process (``python -c "from plait.check.oracle import main; main()"``): runs
    the job at each path that arrives on stdin, one a line, until stdin closes. A job file holds the
    caller's ``sys.path`` (so the factory imports as it did there) and the job; a job that fails
    leaves its error in its folder (`Exchange.fail`) and the process goes on to the next. It ends
    when the process that started it does, mid-job included."""
    die_with_parent(signal.SIGKILL)
    for line in sys.stdin:
        with open(line.rstrip("\n"), "rb") as f:
            sys_path, job = pickle.load(f)
        sys.path[:] = sys_path
        spec, folder, timeout_s, threads = pickle.loads(job)
        exchange = Exchange(folder, timeout_s)
        try:
            torch.set_num_threads(threads)
            run_oracle(spec, exchange)
        except Exception as e:
            exchange.fail(e, traceback.format_exc())


def run_oracle(spec: Spec, exchange: Exchange) -> None:
    device = init(seed=spec.seed, backend=spec.backend)  # a world of one, on the ranks' kind of device
    model, make_batch, user_loss = build(spec)
    if is_meta(model):  # the values `plait.parallelize` gives a meta model (ties kept)
        materialize(model, spec.plan.seed, keep_whole(device))
    model.to(device)
    if spec.plan.precision is not None:  # the layout's casts, in one process
        mixed_precision(model, spec.plan.precision)
    vocab = (spec.vocab or vocab_of(model)) if make_batch is None else None
    if make_batch is None:
        refuse_longer_than_context(model, spec.seq)
    loss_fn = user_loss or next_token_loss
    exchange.put_step(0, {"state": _state(model)})
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    recorder = Recorder(model.named_modules()) if spec.activations else None
    for step in range(1, spec.steps + 1):
        inputs, targets = _global_batch(spec, step, make_batch, vocab, device)
        slices = [] if recorder is None else [_probe(model, recorder, spec, inputs, d)
                                              for d in range(spec.data_size)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*as_args(inputs)), targets)
        loss.backward()
        opt.step()
        exchange.put_step(step, {"inputs": map_tensors(torch.Tensor.cpu, inputs),
                                 "targets": map_tensors(torch.Tensor.cpu, targets),
                                 "loss": float(loss.detach()), "state": _state(model)}, slices)


def refuse_longer_than_context(model: nn.Module, seq: int) -> None:
    """The default batches' sequences must fit the positions the model has: plait's GPT's
    ``cfg.seq_len`` (its rotary tables), a transformers config's ``n_positions`` or
    ``max_position_embeddings``. Past them a model fails on a shape or runs positions it was not
    built for."""
    for holder, names in ((getattr(model, "cfg", None), ("seq_len",)),
                          (getattr(model, "config", None), ("n_positions", "max_position_embeddings"))):
        for name in names:
            most = getattr(holder, name, None)
            if isinstance(most, int) and seq > most:
                raise CheckInputError(f"--seq {seq} (check(seq=...)) is longer than {type(model).__name__}'s "
                                      f"{name} = {most}: check sequences of at most {most} tokens, or build "
                                      "the model with more positions")


def vocab_of(model: nn.Module) -> int:
    """The vocabulary random token ids are drawn from: ``config.vocab_size`` (Hugging Face),
    ``cfg.vocab_size`` (plait's GPT), else the first embedding's size."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None)):
        size = getattr(holder, "vocab_size", None)
        if isinstance(size, int):
            return size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise CheckInputError(f"{type(model).__name__} has no vocabulary the check can find (no config."
                              "vocab_size, no nn.Embedding): pass vocab=... (--vocab) or return (model, "
                              "make_batch, loss_fn) from the factory")
    return emb.num_embeddings


def _global_batch(spec: Spec, step: int, make_batch: BatchFn | None, vocab: int | None,
                  device: torch.device) -> tuple[Any, Any]:
    if make_batch is None:
        assert vocab is not None
        g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
        ids = torch.randint(0, vocab, (spec.batch_size, spec.seq + 1), generator=g, device="cpu")
        batch: Any = (ids[:, :-1], ids[:, 1:])
    else:
        torch.manual_seed(spec.seed * 1_000_003 + step)  # whatever it draws, a known batch per step
        batch = make_batch(step)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise CheckInputError(f"make_batch({step}) must return (inputs, targets), got "
                                  f"{type(batch).__name__}")
    parts = spec.data_size * spec.microbatches
    for what, b in zip(("inputs", "targets"), batch):
        for t in tensors_in(b):
            if t.dim() == 0 or t.shape[0] % parts:
                raise CheckInputError(f"the batch's {what} need dim 0 divisible by the data-parallel size "
                                      f"{spec.data_size} x microbatches {spec.microbatches}; got shape "
                                      f"{tuple(t.shape)}")
    dt = spec.dtype
    inputs, targets = (map_tensors(lambda t: t.to(device, dt if t.is_floating_point() else t.dtype), b)
                       for b in batch)
    return inputs, targets


@torch.no_grad()
def _probe(model: nn.Module, recorder: Recorder, spec: Spec, inputs: Any, d: int) -> dict[str, Any]:
    """Every module's output on data slice ``d`` of the batch, microbatch by microbatch as a pipeline
    runs it; the model's buffers and the random state are left as they were.

    A model with `plait.SyncBatchNorm` layers normalizes with the whole batch's statistics in the
    layout, so the slice's outputs are those of the whole batch, cut to the slice's rows (here, a
    world of one, its layers are plain BatchNorm); one microbatch only (a pipeline's microbatches of
    several ranks are not contiguous rows)."""
    whole = spec.microbatches == 1 and _has_sync_batchnorm(model)
    mine = inputs if whole else map_tensors(partial(chunk, m=spec.data_size, i=d), inputs)
    m = spec.microbatches
    saved = {k: b.clone() for k, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        recorder.start()
        for i in range(m):
            model(*as_args(map_tensors(partial(chunk, m=m, i=i), mine)))
        recorder.stop()
    for k, b in model.named_buffers():
        b.copy_(saved[k])
    rows = _rows(inputs)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return chunk(t, spec.data_size, d) if whole and t.dim() and t.shape[0] == rows else t

    return {"outputs": [(name, call, recorder.order[(name, call)], [cut(t).cpu() for t in ts])
                        for (name, call), ts in recorder.outputs.items()]}


def _has_sync_batchnorm(model: nn.Module) -> bool:
    from plait.compose.sync_batchnorm import SyncBatchNorm

    return any(isinstance(m, SyncBatchNorm) for m in model.modules())


def _rows(inputs: Any) -> int:
    """The global batch's number of rows (its first tensor's dim 0)."""
    first = next(iter(tensors_in(inputs)), None)
    return int(first.shape[0]) if first is not None and first.dim() else -1


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
