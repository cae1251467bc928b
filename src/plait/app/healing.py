"""`plait train --heal`: data-parallel replicas that heal without a restart.

The command's process becomes the supervisor (`plait.runtime.heal.supervisor`): it hosts the run's
store, starts the replicas and, with ``--heal-replace``, a standby that replaces the first to die
(and another standby behind it). A replica is one process under ``--strategy ddp`` (``--nproc``
replicas) and ``--nproc / --dp`` processes under HSDP (``--strategy fsdp --dp R``: R replicas,
each sharding the model over its processes). Each replica is a world of its own for
torch.distributed; gradients are summed across replicas over the process groups of the current
membership epoch (`plait.runtime.heal.replicas`). A step is:

1. this process's share of the global batch (`plait.runtime.heal.split`: even, the first ones one larger);
2. forward and backward. DDP divides this replica's gradient by B / k (its k of B samples) and sums
   it over the replicas in backward, so the sum is the mean over the samples actually used. Under
   HSDP each process's loss is weighted alike (times its k samples x F processes / B) before FSDP
   averages it over the replica's F processes, and the replica's gradient shards are summed over
   the replicas after backward, one flat all-reduce per process;
3. one small all-reduce: the loss weighted alike, the sample count (must be B), the join requests
   the leader read from the store, and with ``--log-samples`` the sample ids each process read;
   under HSDP the replica's processes then agree that all of it succeeded;
4. clipping and the optimizer step, only after every collective of the step succeeded.

A collective that fails (a peer died, or hung past ``--heal-timeout``) is caught before the
optimizer step: the survivors agree on the live replicas and redo the step over them. Each
replica writes its membership events to ``RUN/heal/uid<N>.jsonl`` and the supervisor its starts and
exits to ``RUN/heal/supervisor.jsonl``: the recovery times in bench/RESULTS.md are read from them.
"""

from __future__ import annotations

import datetime as _dt
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
from plait.state.dtensors import local_of


def _events(path: Path) -> Callable[[dict[str, Any]], None]:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(event: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")

    return write


def cli_main(cfg: TrainConfig) -> int:
    """Supervise ``cfg.parallel.nproc`` healing replicas; the exit code of ``plait train``."""
    assert cfg.run.name is not None  # chosen by the command before it gets here
    if torch.cuda.is_available():
        # The epochs' groups are Gloo's: a dead peer closes its sockets, which NCCL does not show
        # without a communicator abort. Training on the CPU here would leave the GPUs idle, silently.
        print("plait train: error: --heal runs its replicas on the CPU with Gloo (NCCL groups are not "
              "healed yet), and this machine has CUDA: train without --heal (a job that restarts and "
              "resumes by itself: --resume auto under plait run --max-restarts), or hide the GPUs "
              "(CUDA_VISIBLE_DEVICES=) to heal on the CPU", file=sys.stderr)
        return 2
    folder = Path(cfg.run.run_dir) / cfg.run.name
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.nproc)
    replicas = replica_count(cfg)
    supervisor = Supervisor(replica_main, replicas, (cfg,),
                            replacements=replicas if cfg.parallel.heal_replace else 0,
                            threads=threads, grace_s=3 * cfg.parallel.heal_timeout + 10,
                            events=_events(folder / "heal" / "supervisor.jsonl"),
                            per_replica=cfg.parallel.nproc // replicas)
    try:
        return supervisor.run()
    except ReplicasFailed as e:
        traces = folder / "traces"
        where = f"; tracebacks in {traces}" if traces.is_dir() else ""
        print(f"plait train: error: {e}{where}", file=sys.stderr)
        return 1


def replica_count(cfg: TrainConfig) -> int:
    """How many replicas ``plait train --heal`` runs: --dp under HSDP, else --nproc."""
    return cfg.parallel.dp if cfg.parallel.strategy == "fsdp" else cfg.parallel.nproc


@dataclass
class _Run:
    """What a replica's steps read: the config, the model (DDP, or FSDP within the replica) and its
    loss, the data."""

    cfg: TrainConfig
    model: nn.Module
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
        name = _process_name(member)
        path = record_failure(name, e, Path(cfg.run.run_dir) / str(cfg.run.name) / "traces")
        print(f"plait train: replica {name}: {one_line(e)}; traceback in {path}", file=sys.stderr)
        raise SystemExit(1) from None


def _process_name(member: Membership) -> str:
    """``uid`` of a one-process replica, ``uid.index`` of a process of a larger one (file names)."""
    return f"{member.uid}" + (f".{member.index}" if member.per_replica > 1 else "")


def _build(cfg: TrainConfig, member: Membership) -> tuple[_Run, LiveState]:
    from plait.app.step import factory_loss

    timeout_s = max(60.0, cfg.parallel.heal_timeout)
    if member.per_replica > 1:
        # The replica's processes are a world of their own, met through the run's store; a process
        # that dies takes only its replica's world down (the supervisor then ends the replica).
        world = dist.PrefixStore(f"heal/world/{member.uid}", member.connect())
        dist.init_process_group("gloo", store=world, rank=member.index, world_size=member.per_replica,
                                timeout=_dt.timedelta(seconds=timeout_s))
    # On the CPU: the epochs' groups are Gloo groups (NCCL ones are not healed yet).
    device = plait.init(seed=cfg.run.seed, timeout_s=timeout_s, backend="gloo")
    folder = Path(cfg.run.run_dir) / str(cfg.run.name)
    comm.configure(run_dir=str(folder / "heal" / f"uid{_process_name(member)}"))  # its flight records
    corpus = load_corpus(cfg.data.path, max_bytes=cfg.data.max_bytes, dtype=cfg.data.data_dtype,
                         eval_path=cfg.data.eval_data, info=getattr(cfg, "_data_info", None),
                         tokenizing=cfg.tokenizing())
    # Every replica builds the same model from the seed; a joiner's is overwritten by a peer's state.
    model = _replica_model(cfg, member, device)
    loss_fn = factory_loss(cfg) if cfg.model_factory is not None else lm_loss
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                            betas=(0.9, 0.95))
    batch, seq = cfg.data.batch_size, cfg.seq_len
    run = _Run(cfg, model, loss_fn, BatchSampler(corpus.train, seq, batch, seed=cfg.run.seed),
               BatchSampler(corpus.val, seq, batch, seed=cfg.run.seed + 1),
               runlog.RunLog(folder, active=True), batch * seq)
    if member.initial is not None and member.uid == 0 and member.index == 0:
        run.log.header({"run_id": cfg.run.name, "heal": True, "replicas": replica_count(cfg),
                        "processes_per_replica": member.per_replica,
                        "heal_timeout_s": cfg.parallel.heal_timeout, "tokens_per_step": run.tokens_per_step})
    return run, LiveState(model, opt)


def _replica_model(cfg: TrainConfig, member: Membership, device: torch.device) -> nn.Module:
    """One replica's model: a DDP of one process (its group set per epoch), or the model sharded
    over the replica's processes (FSDP at --zero-stage, the layout's other options as given)."""
    from plait.app.step import unwrapped_model

    if member.per_replica == 1:
        return DistributedDataParallel(unwrapped_model(cfg, device), Mesh(dp=1), broadcast_buffers=False)
    from plait.compose.parallelize import parallelize

    model = unwrapped_model(cfg, "meta" if cfg.model.hf_config is None and cfg.model_factory is None
                            else device)
    sharded = parallelize(model, Mesh(fsdp=member.per_replica), cfg.parallel_plan(model))
    assert isinstance(sharded, nn.Module)  # no pipeline: --heal refuses --pp
    return sharded


def _train(member: Membership, cfg: TrainConfig) -> None:
    run, state = _build(cfg, member)
    folder = Path(cfg.run.run_dir) / str(cfg.run.name)
    events = _events(folder / "heal" / f"uid{_process_name(member)}.jsonl")
    replicas = Replicas(member.connect(), member.uid, cfg.parallel.heal_timeout, events,
                        index=member.index, per_replica=member.per_replica)
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
                         "strategy": cfg.parallel.strategy, "heal": True})
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
        if isinstance(run.model, DistributedDataParallel):
            # Let go of the failed group (DDP's buckets hold its collectives): alone until regrouped.
            run.model.regroup(dist.group.WORLD, 1)
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
    sharded = replicas.per_replica > 1
    if not sharded:
        assert isinstance(run.model, DistributedDataParallel)
        run.model.regroup(replicas.group, replicas.size, batch / (hi - lo))
    for g in state.optimizer.param_groups:  # here: a redone step may follow a state received
        g["lr"] = lr_at(step, cfg)
    state.optimizer.zero_grad(set_to_none=True)
    loss = run.loss_fn(run.model(x), y)
    # DDP sums the gradients / (B / k) over the epoch's group; FSDP averages its processes' over the
    # replica, so each is weighted by its k samples of B first (then summed over the replicas below).
    (loss * (replicas.per_replica * (hi - lo) / batch) if sharded else loss).backward()
    # The loss weighted as the gradient, the samples read, a stop signal's number, the sample ids.
    stats = torch.zeros(3 + (batch if cfg.run.log_samples else 0), dtype=torch.float64)
    signum = stop.signum  # read once: a signal arriving after the all-reduce counts at the next step
    stats[0], stats[1], stats[2] = float(loss.detach()) * (hi - lo) / batch, hi - lo, signum
    if cfg.run.log_samples:
        stats[3 + lo: 3 + hi] = torch.from_numpy(ids.astype("float64"))
    grads = [p.grad for p in run.model.parameters() if p.grad is not None] if sharded else None
    total = replicas.reduce(stats, grads)
    if int(total[1]) != batch:
        raise RuntimeError(f"plait.runtime.heal: the replicas read {int(total[1])} samples of a global "
                           f"batch of {batch}")
    norm = clip_grad_norm_(run.model, cfg.optimizer.grad_clip or math.inf)
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
    run.model.eval()
    total = sum(run.loss_fn(run.model(x), y).item()
                for x, y in (run.val.batch_at(i) for i in range(run.cfg.run.eval_batches)))
    run.model.train()
    return total / run.cfg.run.eval_batches


def params_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes (this process's shards), in order: equal digests mean
    bit-equal replicas (process by process under HSDP)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local_of(p).detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
