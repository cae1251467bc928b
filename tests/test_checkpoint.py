"""Checkpoints written by one layout resume on another and continue the same loss curve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from oracle import TRAIN_BASE, train_losses

from plait.app.train import TrainConfig


@pytest.fixture(scope="module")
def zero3_checkpoint(pools, tmp_path_factory):
    """ZeRO-3 on 4 ranks, saving every 3 steps; returns a folder holding only the step-3 save."""
    return _saved_at_step_3(pools[4], tmp_path_factory.mktemp("ckpt"), strategy="fsdp", nproc=4)


def _saved_at_step_3(pool, root, **layout):
    """Train with saves every 3 steps; (a folder holding only the step-3 save, the losses)."""
    losses = pool.run(train_losses, str(root), save_dir=str(root / "all"), save_every=3, **layout)[0]
    only3 = root / "only3"
    shutil.copytree(root / "all" / "step_000003", only3 / "step_000003")
    return only3, losses


def _resume(pools, folder, tmp_path, world: int, **layout) -> list[float]:
    """Losses of steps 4-6 resumed from a copy of ``folder`` on ``world`` ranks (1: in process)."""
    work = tmp_path / "resume"
    shutil.copytree(folder, work)
    if world == 1:
        return train_losses(str(tmp_path), save_dir=str(work), resume=True, **layout)
    return pools[world].run(train_losses, str(tmp_path), save_dir=str(work), resume=True, **layout)[0]


def test_zero3_run_with_saves_matches_oracle(oracle, zero3_checkpoint):
    assert zero3_checkpoint[1] == pytest.approx(oracle, rel=1e-4)


@pytest.mark.parametrize("world,layout", [
    (2, dict(strategy="ddp", nproc=2)),
    (2, dict(strategy="fsdp", nproc=2, zero_stage=2)),
])
def test_resume_on_another_world_size_and_layout(pools, oracle, zero3_checkpoint, tmp_path, world, layout):
    losses = _resume(pools, zero3_checkpoint[0], tmp_path, world, **layout)
    # Steps 4-6 continue exactly where the 4-rank ZeRO-3 run stopped (Adam moments restored too).
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_resume_in_one_process(pools, oracle, zero3_checkpoint, tmp_path):
    losses = _resume(pools, zero3_checkpoint[0], tmp_path, 1, strategy="none", nproc=1)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_zero3_checkpoint_resumes_context_parallel_and_back(pools, oracle, zero3_checkpoint, tmp_path):
    # FSDP over fsdp x cp holds other shards than ZeRO-3 over 4 ranks; both are the same model.
    cp = dict(strategy="fsdp", nproc=4, cp=2, cp_algorithm="allgather")
    losses = _resume(pools, zero3_checkpoint[0], tmp_path / "in", 4, **cp)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)
    folder, losses = _saved_at_step_3(pools[4], tmp_path / "cp", **cp)
    assert losses == pytest.approx(oracle, rel=1e-4)
    losses = _resume(pools, folder, tmp_path / "out", 1, strategy="none", nproc=1)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_expert_parallel_checkpoint_resumes_on_other_ep_degrees(pools, tmp_path):
    # Experts are saved under their global index by the rank holding them, with their Adam state.
    moe = dict(experts=4, top_k=2, aux_loss_coef=0.0)
    oracle = train_losses(str(tmp_path / "one"), strategy="none", nproc=1, **moe)
    folder, losses = _saved_at_step_3(pools[2], tmp_path / "ep2", strategy="ddp", nproc=2, ep=2, **moe)
    assert losses == pytest.approx(oracle, rel=1e-4)
    for world, layout in ((4, dict(strategy="fsdp", nproc=4, ep=4)), (1, dict(strategy="none", nproc=1))):
        resumed = _resume(pools, folder, tmp_path / f"to{world}", world, **layout, **moe)
        assert resumed == pytest.approx(oracle[3:], rel=1e-4), layout


def test_resume_without_save_dir_or_name_is_rejected():
    with pytest.raises(ValueError, match="--resume needs --name .* or --save-dir"):
        TrainConfig.from_flags(resume=True)


# ------------------------------------------------------------------ the data stream across layouts
def _stream(tmp: str, **flags) -> tuple[list[float], list[list[int]]]:
    """`plait train --log-samples` on this rank: the losses and the global batch's sample ids of each
    step this run took, as rank 0's metrics.jsonl records them (picklable for rank pools)."""
    import torch.distributed as dist

    from plait.app.train import train

    out = train(TrainConfig.from_flags(**{**TRAIN_BASE, "run_dir": tmp, "log_samples": True, **flags}))
    if dist.get_rank() != 0:
        return out["losses"], []
    rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return out["losses"], [r["samples"] for r in rows if "step" in r]


@pytest.fixture(scope="module")
def dp2_stream(pools, tmp_path_factory):
    """The uninterrupted run at dp 2, saving every 3 steps: (the step-3 save's folder, losses, ids)."""
    root = tmp_path_factory.mktemp("stream")
    losses, ids = pools[2].run(_stream, str(root), strategy="ddp", nproc=2, save_dir=str(root / "all"),
                               save_every=3)[0]
    shutil.copytree(root / "all" / "step_000003", root / "only3" / "step_000003")
    return root / "only3", losses, ids


@pytest.mark.parametrize("world,layout", [(4, dict(strategy="ddp", nproc=4)),
                                          (2, dict(strategy="ddp", nproc=2, tp=2))])
def test_a_run_resumed_in_another_layout_reads_the_global_batches_of_the_uninterrupted_run(
        pools, oracle, dp2_stream, tmp_path, world, layout):
    # dp 2 -> dp 4 splits each global batch over more ranks; dp 2 -> tp 2 (dp 1) reads it whole on
    # both tp ranks. Either way steps 4-6 read the very samples the dp 2 run read, none skipped or
    # repeated, and the losses continue its curve (the layouts' tolerance: fp32 sums in another order).
    folder, losses, ids = dp2_stream
    assert losses == pytest.approx(oracle, rel=1e-4)  # the uninterrupted run is one process's run
    assert len(ids) == 6 and all(len(b) == TRAIN_BASE["batch_size"] for b in ids)
    assert len({tuple(b) for b in ids}) == 6  # every step draws a new global batch
    shutil.copytree(folder, tmp_path / "work")
    got, got_ids = pools[world].run(_stream, str(tmp_path), save_dir=str(tmp_path / "work"), resume=True,
                                    **layout)[0]
    assert got_ids == ids[3:]
    assert got == pytest.approx(losses[3:], rel=1e-4)


def test_a_resume_with_another_global_batch_is_refused_by_name(dp2_stream, tmp_path):
    from plait.state.checkpoint import ForeignCheckpoint

    shutil.copytree(dp2_stream[0], tmp_path / "work")
    other = dict(strategy="none", nproc=1, save_dir=str(tmp_path / "work"), resume=True, batch_size=4)
    with pytest.raises(ForeignCheckpoint, match="batch_size"):
        _stream(str(tmp_path), **other)
    # Told to resume regardless, the stream still refuses: batches of 4 would read other samples.
    with pytest.raises(ValueError, match="global batches of 8 sequences .* resume with --batch-size 8"):
        _stream(str(tmp_path), **other, resume_anyway=True)


# ------------------------------------------------------------------ tensor and pipeline parallelism
@pytest.fixture(scope="module")
def pp_tp_checkpoint(pools, tmp_path_factory):
    """A 2-stage pipeline x tp 2 on 4 ranks, saving at step 3: each rank writes its stage's shards."""
    return _saved_at_step_3(pools[4], tmp_path_factory.mktemp("ckpt_pp_tp"), strategy="ddp", nproc=4, pp=2,
                            tp=2)


def test_pipeline_tp_run_with_saves_matches_oracle(oracle, pp_tp_checkpoint):
    assert pp_tp_checkpoint[1] == pytest.approx(oracle, rel=1e-4)


@pytest.mark.parametrize("world,layout", [
    (1, dict(strategy="none", nproc=1)),
    (2, dict(strategy="ddp", nproc=2, tp=2)),
    (2, dict(strategy="ddp", nproc=2, pp=2, schedule="zb-h1")),
    (4, dict(strategy="ddp", nproc=4, pp=2, tp=2, sequence_parallel=True, schedule="dualpipev")),
])
def test_pipeline_tp_checkpoint_resumes_on_other_layouts(pools, oracle, pp_tp_checkpoint, tmp_path, world,
                                                         layout):
    losses = _resume(pools, pp_tp_checkpoint[0], tmp_path, world, **layout)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_zero3_checkpoint_resumes_as_a_tp_pipeline(pools, oracle, zero3_checkpoint, tmp_path):
    # FSDP's DTensor shards (dim-0 chunks over 4 ranks) load into tp shards of pipeline stages.
    losses = _resume(pools, zero3_checkpoint[0], tmp_path, 4, strategy="ddp", nproc=4, pp=2, tp=2)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_zero3_checkpoint_resumes_as_pipelines_with_zero1(pools, oracle, zero3_checkpoint, tmp_path):
    # Each rank of a stage's fsdp pair reads the Adam state of its share of the parameters only.
    losses = _resume(pools, zero3_checkpoint[0], tmp_path, 4, strategy="fsdp", nproc=4, pp=2, zero_stage=1)
    assert losses == pytest.approx(oracle[3:], rel=1e-4)


def test_pipelines_with_zero1_checkpoint_resumes_in_one_process(pools, oracle, tmp_path):
    folder, losses = _saved_at_step_3(pools[4], tmp_path / "pp_zero1", strategy="fsdp", nproc=4, pp=2,
                                      zero_stage=1, schedule="zb-h1")
    assert losses == pytest.approx(oracle, rel=1e-4)
    resumed = _resume(pools, folder, tmp_path, 1, strategy="none", nproc=1)
    assert resumed == pytest.approx(oracle[3:], rel=1e-4)


def test_fsdp_over_tp_checkpoint_resumes_in_one_process_and_from_zero3(pools, oracle, zero3_checkpoint,
                                                                         tmp_path):
    # FSDP's flat shards of tp shards are written as tp-shard DTensors of the original tensors.
    folder, losses = _saved_at_step_3(pools[4], tmp_path / "fsdp_tp", strategy="fsdp", nproc=4, tp=2)
    assert losses == pytest.approx(oracle, rel=1e-4)
    resumed = _resume(pools, folder, tmp_path / "one", 1, strategy="none", nproc=1)
    assert resumed == pytest.approx(oracle[3:], rel=1e-4)
    resumed = _resume(pools, zero3_checkpoint[0], tmp_path / "z3", 4, strategy="fsdp", nproc=4, tp=2)
    assert resumed == pytest.approx(oracle[3:], rel=1e-4)


def test_vocab_shards_padded_at_the_end_are_dtensor_chunks():
    # 65 rows over tp=2 and 5 rows over tp=4 (one rank empty): DTensor's chunking exactly.
    from plait.state.placement.shards import make_spec
    from plait.state.placement.state import chunk_rows

    assert chunk_rows(make_spec(0, 65, 2, 0), 2) and chunk_rows(make_spec(0, 5, 4, 0), 4)
    assert chunk_rows(make_spec(1, 96, 2, 0, unit=8), 2)
    assert not chunk_rows(make_spec(0, 48, 4, 0, unit=8), 4)  # 16/16/16/0 rows: refused on save



def _tied(seed: int = 5):
    """A float64 GPT whose embedding is tied to its LM head, and its default AdamW."""
    import torch
    from test_pipeline_parity import CFG

    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layers=2, tie_embeddings=True, **CFG)
    model = plait.init_weights(GPT(cfg).to(torch.float64), seed=seed)
    return cfg, model, torch.optim.AdamW(model.parameters())


def _train(model, opt, steps, pipe=None) -> None:
    from oracle import loss64
    from test_pipeline_parity import _batch

    for step in steps:
        x, y = _batch(step)
        if pipe is None:
            loss64(model(x), y).backward()
        else:
            pipe.step(x, y)
        opt.step()
        opt.zero_grad()


def _tied_pipeline_resume(single: str, folder: str, schedule: str) -> list[str]:
    """Load a one-process checkpoint (step 2) into a pipeline whose embedding is tied to the LM
    head (on the other rank; under a V schedule on the same rank), train 2 steps, save, load into a
    fresh pipeline, train 2 more: the parameters match a single process trained for 6 steps."""
    import torch
    from oracle import compare_with_oracle, loss64
    from test_pipeline_parity import TOL64

    from plait import checkpoint
    from plait.models.gpt import GPT
    from plait.pipeline import pipeline
    from plait.testing import cached_mesh

    cfg, oracle, oopt = _tied()

    def build(seed: int):
        with torch.device("meta"):
            model = GPT(cfg).to(torch.float64)
        pipe = pipeline(model, cached_mesh(pp=2), schedule=schedule, microbatches=2, loss_fn=loss64,
                        seed=seed)
        return pipe, torch.optim.AdamW(list(pipe.parameters()))

    pipe, opt = build(6)  # other initial values: everything must come from the checkpoint
    checkpoint.load(single, pipe, opt)  # rank 1's copy takes tok_emb.weight's Adam state
    _train(None, opt, range(2, 4), pipe)
    checkpoint.save(folder, pipe, opt, {"step": 4})
    pipe, opt = build(7)
    checkpoint.load(folder, pipe, opt)
    _train(None, opt, range(4, 6), pipe)
    _train(oracle, oopt, range(6))
    compare_with_oracle(pipe, oracle, "after 6 steps,", lambda p: p.detach(), TOL64)
    return sorted(dict(pipe.named_parameters()))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_with_tied_weights_resumes_a_single_process(pools, tmp_path, schedule):
    import torch.distributed.checkpoint as dcp

    from plait import checkpoint

    _, model, opt = _tied()
    _train(model, opt, range(2))
    single = tmp_path / "single"
    dcp.save(checkpoint.state_dict(model, opt), checkpoint_id=str(single))  # no process group here
    (single / checkpoint.META).write_text('{"step": 2}')
    names = pools[2].run(_tied_pipeline_resume, str(single), str(tmp_path / "tied"), schedule)
    if schedule == "zbv":  # the V: both uses on rank 0, one tensor
        assert "tok_emb.weight" in names[0]
        assert not any(n.startswith(("tok_emb", "lm_head")) for n in names[1])
    else:
        assert "tok_emb.weight" in names[0] and "lm_head.weight" in names[1]


def _pipeline_zero1_save(folder: str) -> None:
    """A 2-stage pipeline (embedding tied to the head on the other stage) on 2 replicas with ZeRO-1
    over dp: two steps, then a save in which each replica writes the Adam state it owns only."""
    import torch
    from oracle import loss64
    from test_pipeline_parity import _batch

    import plait
    from plait import checkpoint, comm
    from plait.models.gpt import GPT
    from plait.testing import cached_mesh

    cfg = _tied()[0]
    mesh = cached_mesh(pp=2, dp=2)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    pipe = plait.pipeline(model, mesh, schedule="1f1b", microbatches=2, loss_fn=loss64, seed=5)
    opt = plait.ZeroRedundancyOptimizer(pipe.parameters(), torch.optim.AdamW, mesh.group("dp"))
    assert 0 < len(opt.owned) < len(list(pipe.parameters()))  # each replica owns a share
    half = slice(mesh.rank("dp") * 4, mesh.rank("dp") * 4 + 4)
    for step in range(2):
        x, y = _batch(step)
        pipe.step(x[half], y[half])
        comm.average_gradients(pipe.parameters(), mesh.group("dp"))
        opt.step()
        opt.zero_grad()
    checkpoint.save(folder, pipe, opt, {"step": 2})


def test_pipeline_with_zero1_checkpoint_loads_in_one_process(pools, tmp_path):
    # The optimizer says which parameters it steps (owns(p)); the checkpoint asks it, whatever its type.
    import torch
    from oracle import assert_params_close
    from test_pipeline_parity import TOL64

    from plait import checkpoint

    pools[4].run(_pipeline_zero1_save, str(tmp_path / "ckpt"))
    _, oracle, oopt = _tied()
    _train(oracle, oopt, range(2))
    _, model, opt = _tied(seed=6)  # other initial values: everything must come from the checkpoint
    checkpoint.load(tmp_path / "ckpt", model, opt)
    assert_params_close({n: p.detach() for n, p in model.named_parameters()},
                        {n: p.detach() for n, p in oracle.named_parameters()}, **TOL64)

    def moments(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return {f"{n}.{k}": v for n, p in m.named_parameters() for k, v in o.state[p].items()}

    assert_params_close(moments(model, opt), moments(oracle, oopt), **TOL64, what="AdamW state")
