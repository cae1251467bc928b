"""`plait train --heal`: data-parallel replicas that heal without a restart.

The command's process becomes the supervisor (`plait.runtime.heal.supervisor`): it hosts the run's
store, starts ``--nproc`` replica processes and, with ``--heal-replace``, a standby that replaces
the first to die (and another standby behind it). Each replica is a world of its own for
torch.distributed; its DDP averages gradients over the process group of the current membership
epoch (`plait.runtime.heal.replicas`). A step is:

1. this replica's share of the global batch (`plait.runtime.heal.split`: even, the first ones one larger);
2. forward and backward, DDP dividing this replica's gradient by B / k (its k of B samples), so the
   sum over the replicas is the mean over the samples actually used;
3. one small all-reduce: the loss weighted alike, the sample count (must be B), the join requests
   the leader read from the store, and with ``--log-samples`` the sample ids each replica read;
4. clipping and the optimizer step, only after every collective of the step succeeded.

A collective that fails (a peer died, or hung past ``--heal-timeout``) is caught before the
optimizer step: the survivors agree on the live replicas and redo the step over them. Each
replica writes its membership events to ``RUN/heal/uid<N>.jsonl`` and the supervisor its starts and
exits to ``RUN/heal/supervisor.jsonl``: the recovery times in bench/RESULTS.md are read from them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.app import runlog
from plait.app.config import TrainConfig
from plait.app.data import BatchSampler, load_corpus
from plait.app.stop import StopRequest
from plait.ddp.wrapper import DistributedDataParallel
from plait.models.gpt import lm_loss
from plait.runtime import comm
from plait.runtime.heal import LiveState, Membership, Replicas, Supervisor
from plait.runtime.heal.quorum import RunOver
from plait.runtime.heal.replicas import FAILURES, MAX_RETRIES, comm_error_line
from plait.runtime.heal.supervisor import ReplicasFailed
from plait.runtime.mesh import Mesh
from plait.state.clip import clip_grad_norm_


def _events(path: Path) -> Callable[[dict[str, Any]], None]:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(event: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")

    return write


def cli_main(cfg: TrainConfig) -> int:
    """Supervise ``cfg.parallel.nproc`` healing replicas; the exit code of ``plait train``."""
    assert cfg.run.name is not None  # chosen by the command before it gets here
    folder = Path(cfg.run.run_dir) / cfg.run.name
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.nproc)
    supervisor = Supervisor(replica_main, cfg.parallel.nproc, (cfg,),
                            replacements=cfg.parallel.nproc if cfg.parallel.heal_replace else 0,
                            threads=threads, grace_s=3 * cfg.parallel.heal_timeout + 10,
                            events=_events(folder / "heal" / "supervisor.jsonl"))
    try:
        return supervisor.run()
    except ReplicasFailed as e:
        traces = folder / "traces"
        where = f"; tracebacks in {traces}" if traces.is_dir() else ""
        print(f"plait train: error: {e}{where}", file=sys.stderr)
        return 1


@dataclass
class _Run:
    """What a replica's steps read: the config, the model and its loss, the data."""

    cfg: TrainConfig
    ddp: DistributedDataParallel
    loss_fn: Callable[..., torch.Tensor]
    sampler: BatchSampler
    val: BatchSampler
    log: runlog.RunLog
    tokens_per_step: int


def replica_main(member: Membership, cfg: TrainConfig) -> None:
    """One replica process: train with the others until the last step (a replacement joins first)."""
    from plait.app.launch import one_line, record_failure

    try:
        _train(member, cfg)
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        path = record_failure(member.uid, e, Path(cfg.run.run_dir) / str(cfg.run.name) / "traces")
        print(f"plait train: replica {member.uid}: {one_line(e)}; traceback in {path}", file=sys.stderr)
        raise SystemExit(1) from None


def _build(cfg: TrainConfig, member: Membership) -> tuple[_Run, LiveState]:
    from plait.app.step import factory_loss, unwrapped_model

    # A world of one, on the CPU: the epochs' groups are Gloo groups (NCCL ones are not healed yet).
    device = plait.init(seed=cfg.run.seed, timeout_s=max(60.0, cfg.parallel.heal_timeout), backend="gloo")
    folder = Path(cfg.run.run_dir) / str(cfg.run.name)
    comm.configure(run_dir=str(folder / "heal" / f"uid{member.uid}"))  # its flight records
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, dtype=cfg.data.data_dtype,
                         eval_path=cfg.data.eval_data, info=getattr(cfg, "_data_info", None),
                         tokenizing=cfg.tokenizing())
    # Every replica builds the same model from the seed; a joiner's is overwritten by a peer's state.
    ddp = DistributedDataParallel(unwrapped_model(cfg, device), Mesh(dp=1), broadcast_buffers=False)
    loss_fn = factory_loss(cfg) if cfg.model_factory is not None else lm_loss
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                            betas=(0.9, 0.95))
    batch, seq = cfg.data.batch_size, cfg.seq_len
    run = _Run(cfg, ddp, loss_fn, BatchSampler(corpus.train, seq, batch, seed=cfg.run.seed),
               BatchSampler(corpus.val, seq, batch, seed=cfg.run.seed + 1),
               runlog.RunLog(folder, active=True), batch * seq)
    if member.initial is not None and member.uid == 0:
        run.log.header({"run_id": cfg.run.name, "heal": True, "replicas": cfg.parallel.nproc,
                        "heal_timeout_s": cfg.parallel.heal_timeout, "tokens_per_step": run.tokens_per_step})
    return run, LiveState(ddp, opt)


def _train(member: Membership, cfg: TrainConfig) -> None:
    run, state = _build(cfg, member)
    folder = Path(cfg.run.run_dir) / str(cfg.run.name)
    events = _events(folder / "heal" / f"uid{member.uid}.jsonl")
    replicas = Replicas(member.connect(), member.uid, cfg.parallel.heal_timeout, events)
    try:
        replicas.start(state, member.initial, member.standby)
    except RunOver:
        return
    with StopRequest() as stop:  # a signal stops every replica after the same step (`_step`)
        try:
            losses = _loop(run, state, replicas, stop)
        except RunOver:  # dropped, and the others finished before it was admitted again
            return
    if replicas.leader:
        run.log.summary({"steps": cfg.run.steps, "steps_done": state.step, "stopped_by": stop.stopped,
                         "final_loss": losses[-1] if losses else None, "replicas": replicas.size,
                         "strategy": "ddp", "heal": True})
    events({"event": "finished", "step": state.step, "params_sha256": params_digest(state.model)})
    replicas.close()
    if stop.exit_code:
        raise SystemExit(stop.exit_code)


def _loop(run: _Run, state: LiveState, replicas: Replicas, stop: StopRequest) -> list[float]:
    cfg, losses = run.cfg, []
    while state.step < cfg.run.steps:
        record = _step_with_retries(run, state, replicas, stop)
        losses.append(record["loss"])
        if cfg.run.eval_every and (state.step % cfg.run.eval_every == 0 or state.step == cfg.run.steps):
            record["eval_loss"] = _evaluate(run)  # every replica alike: no one waits for another
        if replicas.leader:
            run.log.step(record)
        if stop.stopped:
            break
        if state.step < cfg.run.steps:
            replicas.boundary(state)
    return losses


def _step_with_retries(run: _Run, state: LiveState, replicas: Replicas, stop: StopRequest) -> dict[str, Any]:
    """One step, redone over the live replicas after each failure of a peer."""
    for attempt in range(MAX_RETRIES + 1):
        try:
            return _step(run, state, replicas, stop)
        except FAILURES as e:
            if attempt == MAX_RETRIES:
                raise
            error = comm_error_line(e)  # not the error itself: its frames would keep the group open
        # Let go of the failed group (DDP's buckets hold its collectives): on its own until regrouped.
        run.ddp.regroup(dist.group.WORLD, 1)
        state.optimizer.zero_grad(set_to_none=True)
        replicas.recover(state, error)
    raise AssertionError("unreachable")


def _step(run: _Run, state: LiveState, replicas: Replicas, stop: StopRequest) -> dict[str, Any]:
    from plait.app.step import lr_at

    t0 = time.perf_counter()
    cfg, batch, step = run.cfg, run.cfg.data.batch_size, state.step
    lo, hi = replicas.share(batch)
    ids = run.sampler.global_ids(step)[lo:hi]
    x, y = run.sampler.windows(ids)
    run.ddp.regroup(replicas.group, replicas.size, batch / (hi - lo))
    for g in state.optimizer.param_groups:  # here: a redone step may follow a state received
        g["lr"] = lr_at(step, cfg)
    state.optimizer.zero_grad(set_to_none=True)
    loss = run.loss_fn(run.ddp(x), y)
    loss.backward()  # DDP sums the gradients / (B / k) over the epoch's group
    # The loss weighted as the gradient, the samples read, a stop signal's number, the sample ids.
    stats = torch.zeros(3 + (batch if cfg.run.log_samples else 0), dtype=torch.float64)
    signum = stop.signum  # read once: a signal arriving after the all-reduce counts at the next step
    stats[0], stats[1], stats[2] = float(loss.detach()) * (hi - lo) / batch, hi - lo, signum
    if cfg.run.log_samples:
        stats[3 + lo: 3 + hi] = torch.from_numpy(ids.astype("float64"))
    total = replicas.reduce(stats)
    if int(total[1]) != batch:
        raise RuntimeError(f"plait.runtime.heal: the replicas read {int(total[1])} samples of a global "
                           f"batch of {batch}")
    norm = clip_grad_norm_(run.ddp, cfg.optimizer.grad_clip or math.inf)
    state.optimizer.step()
    state.step += 1
    stop.stopped = (signum or signal.SIGTERM) if total[2] > 0 else 0  # what every replica summed
    dt = time.perf_counter() - t0
    assert replicas.epoch is not None
    record: dict[str, Any] = {"step": state.step, "loss": float(total[0]),
                              "lr": state.optimizer.param_groups[0]["lr"], "grad_norm": float(norm),
                              "tokens_per_s": run.tokens_per_step / dt,
                              "step_time_s": dt, "time": time.time(), "replicas": replicas.size,
                              "epoch": replicas.epoch.number}
    if cfg.run.log_samples:
        record["samples"] = [int(i) for i in total[3:].tolist()]
    return record


@torch.no_grad()
def _evaluate(run: _Run) -> float:
    run.ddp.eval()
    total = sum(run.loss_fn(run.ddp(x), y).item()
                for x, y in (run.val.batch_at(i) for i in range(run.cfg.run.eval_batches)))
    run.ddp.train()
    return total / run.cfg.run.eval_batches


def params_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: equal digests mean bit-equal replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
