"""Pipeline API: splitting, tuple activations, custom schedules, timelines and clear errors."""

from __future__ import annotations

import pytest
import torch
from oracle import compare_with_oracle, loss64
from test_pipeline_parity import CFG, TOL64, _batch, _parity
from torch import nn

from plait.testing import cached_mesh

TOL = dict(rtol=1e-5, atol=1e-6)  # float32, one step, no optimizer: summation order only


# ------------------------------------------------------------------ splitting (no ranks)
def test_auto_split_of_30_layers_on_4_stages_keeps_every_layer():
    from plait.models.gpt import GPT, GPTConfig
    from plait.pipeline.split import plan_stages, segments

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=30, d_model=64, n_heads=4))
    segs = segments(model)
    assert [n for n, _ in segs][:3] == ["tok_emb", "drop", "layers.0"] and segs[-1][0] == "lm_head"
    plan = plan_stages(segs, 4, "auto")
    assert sum(plan, []) == list(range(len(segs)))  # each segment once, in order
    sizes = [sum(p.numel() for i in idx for p in segs[i][1].parameters()) for idx in plan]
    assert max(sizes) / min(sizes) < 1.2, sizes
    manual = plan_stages(segs, 3, ["layers.10", "layers.20"])
    assert [segs[idx[0]][0] for idx in manual] == ["tok_emb", "layers.10", "layers.20"]


def test_split_errors_name_the_problem():
    from plait.models.gpt import GPT, GPTConfig
    from plait.pipeline.split import plan_stages, segments

    with torch.device("meta"):
        segs = segments(GPT(GPTConfig(n_layers=2)))
    with pytest.raises(ValueError, match="'layers.9' is not a segment"):
        plan_stages(segs, 2, ["layers.9"])
    with pytest.raises(ValueError, match="need 1 segment names"):
        plan_stages(segs, 2, ["layers.0", "norm"])
    with pytest.raises(ValueError, match="must come after"):
        plan_stages(segs, 3, ["norm", "layers.1"])
    with pytest.raises(ValueError, match="only 6 segments"):
        plan_stages(segs, 8, "auto")


def test_uneven_manual_split_pp2(pools):
    # Stage 0: tok_emb, drop, layers.0..1; stage 1: layers.2, norm, lm_head.
    pools[2].run(_parity, 2, "1f1b", 4, 1, 3, ["layers.2"])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fewer_microbatches_than_stages(pools, schedule):
    pools[4].run(_parity, 4, schedule, 2, 1, 5)


@pytest.mark.parametrize("pp,schedule", [(2, "1f1b"), (4, "zb-h1")])
def test_embedding_tied_across_first_and_last_rank(pools, pp, schedule):
    # The LM head on the last rank shares tok_emb.weight of the first: both start from tok_emb's
    # initial values, their gradients are summed, and both copies follow the oracle's weight.
    out = pools[pp].run(_parity, pp, schedule, 4, 1, 3, "auto", 5, True)
    assert "tok_emb.weight" in out[0]["names"] and "lm_head.weight" in out[-1]["names"]


def _accumulated_tie(pp: int, schedule: str, calls: int, steps: int = 2) -> float:
    """``calls`` pipe.step's per optimizer step next to one process backpropagating the sum of the
    same batches' mean losses; returns the worst gradient error relative to the oracle's norm."""
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.pipeline import pipeline

    cfg = GPTConfig(n_layers=3, tie_embeddings=True, **CFG)
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.float64)
    pipe = pipeline(model, cached_mesh(pp=pp), schedule=schedule, microbatches=4, loss_fn=loss64, seed=3)
    mine, ref = dict(pipe.named_parameters()), dict(oracle.named_parameters(remove_duplicate=False))
    opt, oopt = torch.optim.AdamW(mine.values()), torch.optim.AdamW(oracle.parameters())
    worst = 0.0
    for step in range(steps):
        for c in range(calls):
            x, y = _batch(step * calls + c)
            pipe.step(x, y)
            loss64(oracle(x), y).backward()
        compare_with_oracle(pipe, oracle, f"step {step}, gradient of", lambda p: p.grad, TOL64)
        relative = (float((p.grad - ref[n].grad).norm() / ref[n].grad.norm()) for n, p in mine.items())
        worst = max(worst, *relative)
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    compare_with_oracle(pipe, oracle, f"after {steps} steps,", lambda p: p.detach(), TOL64)
    return worst


@pytest.mark.parametrize("pp,schedule,calls", [(2, "1f1b", 2), (4, "zb-h1", 3)])
def test_tied_embedding_accumulates_over_several_steps(pools, pp, schedule, calls):
    # Gradient accumulation: each call adds its own contribution to the tied copies' gradients;
    # what earlier calls summed between the copies' ranks is not summed again.
    pools[pp].run(_accumulated_tie, pp, schedule, calls)


def _modes() -> dict:
    """Dropout 0.5 at pp=2: after ``eval()`` a training step is the oracle's in eval mode
    (loss and gradients); ``train()`` brings dropout back."""
    import plait
    from plait.models.gpt import GPT, GPTConfig
    from plait.pipeline import pipeline

    torch.manual_seed(0)  # the dropout masks drawn below, whatever ran before on this rank
    cfg = GPTConfig(n_layers=2, dropout=0.5, **CFG)
    oracle = plait.init_weights(GPT(cfg).to(torch.float64), seed=3).eval()
    pipe = pipeline(plait.init_weights(GPT(cfg).to(torch.float64), seed=3), cached_mesh(pp=2),
                    microbatches=2, loss_fn=loss64)
    x, y = _batch(0)
    assert pipe.eval() is pipe and not pipe.training
    loss, want = pipe.step(x, y), loss64(oracle(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), **TOL64)
    compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL64)
    pipe.train()
    return {"training": pipe.training, "eval": float(loss), "train": float(pipe.step(x, y))}


def test_train_and_eval_modes_switch_dropout(pools):
    out = pools[2].run(_modes)
    assert all(o["training"] for o in out)
    assert abs(out[0]["train"] - out[0]["eval"]) > 1e-3  # dropout is on again


# ------------------------------------------------------------------ tuple activations
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab_size"], 16)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The token ids travel on as a tensor that needs no gradient.
        return self.emb(ids), ids


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gate = (ids % 3 == 0).unsqueeze(-1).float()
        return torch.tanh(self.a(h)) + gate, self.b(h), ids


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, CFG["vocab_size"])

    def forward(self, h: torch.Tensor, g: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.out(h * torch.sigmoid(g))


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.mix = Mix()
        self.merge = Merge()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.merge(*self.mix(*self.embed(ids)))


def _tuple_parity(schedule: str) -> float:
    import plait
    from plait.pipeline import pipeline

    mesh = cached_mesh(pp=2)
    oracle = plait.init_weights(TupleNet().to(torch.float64), seed=1)
    with torch.device("meta"):
        model = TupleNet().to(torch.float64)
    pipe = pipeline(model, mesh, split=["mix"], schedule=schedule, microbatches=4, loss_fn=loss64, seed=1)
    opt = torch.optim.AdamW([p for _, p in pipe.named_parameters()])
    oopt = torch.optim.AdamW(oracle.parameters())
    for step in range(5):
        x, y = _batch(step)
        loss = pipe.step(x, y)
        loss64(oracle(x), y).backward()
        if step == 0:
            compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL64)
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    compare_with_oracle(pipe, oracle, "after 5 steps,", lambda p: p.detach(), TOL64)
    return float(loss)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_tuples_and_tensors_without_grad_pass_between_stages(pools, schedule):
    losses = pools[2].run(_tuple_parity, schedule)
    assert losses[0] == losses[1]


# ------------------------------------------------------------------ custom schedules, timelines
def _custom_and_timeline() -> dict:
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Action, Kind, pipeline

    mesh = cached_mesh(pp=2)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=2, **CFG))
    # Compute order only (the sends and receives are added): forwards, then backwards in reverse.
    rows = [[*(Action(Kind.F, r, mb) for mb in range(2)), *(Action(Kind.BW, r, mb) for mb in (1, 0))]
            for r in range(2)]
    pipe = pipeline(model, mesh, schedule=rows, microbatches=2, loss_fn=lm_loss)
    x, y = _batch(0)
    loss = pipe.step(x, y)
    everyone = pipe.gather_timelines()
    return {"loss": float(loss), "kinds": [s.action.kind.value for s in pipe.timeline],
            "bubble": pipe.bubble_fraction, "ranks": len(everyone), "text": pipe.schedule.text()}


def test_custom_action_list_and_timeline(pools):
    out = pools[2].run(_custom_and_timeline)
    assert out[0]["loss"] == out[1]["loss"]
    assert out[0]["kinds"] == ["F", "SEND_F", "F", "SEND_F", "RECV_B", "BW", "RECV_B", "BW"]
    assert all(0.0 <= o["bubble"] < 1.0 for o in out) and out[0]["ranks"] == 2
    assert "rank 1:" in out[0]["text"]


# ------------------------------------------------------------------ one group per direction (NCCL's)
@pytest.mark.parametrize("pp,schedule,m,chunks", [(2, "gpipe", 4, 1), (2, "interleaved", 4, 2),
                                                  (2, "zb-h1", 8, 1), (4, "1f1b", 8, 1)])
def test_one_group_per_direction_matches_single_process(pools, pp, schedule, m, chunks):
    # The mode NCCL gets (messages matched by order on a group per direction), run here on Gloo.
    out = pools[pp].run(_parity, pp, schedule, m, chunks, 4, "auto", 3, False, "directed")
    me = [o["links"] for o in out]
    # Rank 0 of pp=2 sends to and receives from rank 1: two directions; interior ranks of pp=4: four.
    assert me[0] == [(0, 1), (1, 0)] and (pp == 2 or len(me[1]) == 4)


# ------------------------------------------------------------------ W fills waits at run time
class SlowHead(nn.Module):
    """A last stage slow enough that the first rank waits for its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, CFG["vocab_size"])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.09)  # long beside a busy machine's scheduling delays (the order, not a time, is tested)
        return self.out(torch.tanh(h))


class _SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.15)
        return g


class SlowEmbed(nn.Module):
    """A first stage whose backward is slow: the last rank idles at the end of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG["vocab_size"], 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _SlowGrad.apply(self.emb(ids))


class SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = SlowEmbed()
        self.body = nn.Linear(16, 16)
        self.head = SlowHead()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(ids)))


def _w_fills_wait() -> dict:
    import plait
    from plait.models.gpt import lm_loss
    from plait.pipeline import Action, Kind, pipeline

    mesh = cached_mesh(pp=2)
    oracle = plait.init_weights(SlowNet(), seed=2)
    with torch.device("meta"):
        model = SlowNet()
    pipe = pipeline(model, mesh, split=["body"], schedule="zb-h1", microbatches=4, loss_fn=lm_loss, seed=2)
    x, y = _batch(0)
    loss = pipe.step(x, y)
    lm_loss(oracle(x), y).backward()
    compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL)
    plan = list(pipe.schedule.actions[mesh.rank("pp")])
    ran = [s.action for s in pipe.timeline]
    return {"loss": float(loss), "plan": plan, "ran": ran, "end": pipe.timeline[-1].end,
            "step_time": pipe.step_time, "bubble": pipe.bubble_fraction,
            "w0": Action(Kind.W, 0, 0), "recv": Action(Kind.RECV_B, 0, 1)}


def test_waiting_rank_runs_pending_weight_gradients(pools):
    out = pools[2].run(_w_fills_wait)
    assert out[0]["loss"] == out[1]["loss"]
    r0 = out[0]
    w0, recv = r0["w0"], r0["recv"]
    # Listed after the receive of microbatch 1's gradient; run while that gradient was on its way.
    assert r0["plan"].index(w0) > r0["plan"].index(recv)
    assert r0["ran"].index(w0) < r0["ran"].index(recv)
    assert sorted(map(str, r0["ran"])) == sorted(map(str, r0["plan"]))  # each action exactly once
    # The step time spans the whole pipeline: rank 1 finishes its actions while rank 0 still runs
    # its last (slow) W, and that tail counts as rank 1's idle time.
    r1 = out[1]
    assert r1["step_time"] - r1["end"] > 0.03 and r1["bubble"] > 0.03 / r1["step_time"]


# ------------------------------------------------------------------ errors before any collective
class HeadFirst(nn.Module):
    """Registers its head before the body it reads: split at 'body', stage 0 would need stage 1's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CFG["vocab_size"], 16)
        self.head = nn.Linear(16, CFG["vocab_size"])
        self.body = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _bad(case: str) -> None:
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Action, Kind, pipeline

    mesh = cached_mesh(pp=2)
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layers=2, **CFG))
    x, y = _batch(0)
    if case == "microbatches":
        pipeline(gpt, mesh, microbatches=0, loss_fn=lm_loss)
    elif case == "batch":
        pipeline(gpt, mesh, microbatches=3, loss_fn=lm_loss).step(x, y)
    elif case == "order":
        with torch.device("meta"):
            res = HeadFirst()
        pipeline(res, mesh, split=["body"], microbatches=2, loss_fn=lm_loss).step(x, y)
    elif case == "schedule":
        rows = [[Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0)], [Action(Kind.F, 1, 0), Action(Kind.BW, 1, 0)]]
        rows[0] = rows[0][::-1]  # backward before forward
        pipeline(gpt, mesh, schedule=rows, microbatches=1, loss_fn=lm_loss)
    elif case == "interleaved":
        pipeline(gpt, mesh, schedule="interleaved", chunks=2, microbatches=1, loss_fn=lm_loss)
    elif case == "p2p":
        pipeline(gpt, mesh, microbatches=2, loss_fn=lm_loss, p2p="nccl")
    elif case == "compiled":  # with the split names its segments would have under the wrapper
        pipeline(torch.compile(gpt, backend="eager"), mesh, split=["_orig_mod.layers.1"], microbatches=2,
                 loss_fn=lm_loss).step(x, y)
    elif case == "compiled-zb":
        gpt.layers[1].compile(backend="aot_eager")
        pipeline(gpt, mesh, schedule="zb-h1", microbatches=2, loss_fn=lm_loss)


@pytest.mark.parametrize("case,message", [
    ("microbatches", "microbatches must be a positive integer, got 0"),
    ("batch", "inputs batch size 8 is not divisible by microbatches=3"),
    ("order", r"segment 'head' \(stage 0\) reads the output of 'body', which the split puts on a later"),
    ("schedule", r"rank 0, action #0 RECV_B\(stage=0, mb=0\): deadlock: it waits for SEND_B\(stage=1"),
    ("interleaved", "microbatches=1 < pp=2"),
    ("p2p", "p2p must be one of"),
    # Its compiled forward would run the whole model on every rank: stage 0 got no gradients.
    ("compiled", r"the model is torch.compile'd \(OptimizedModule around GPT\).* Pass the uncompiled module "
                 r"\(`_orig_mod` of the compiled one\) and compile its blocks in place first: `for block in "
                 r"model.layers: block.compile\(\)`"),
    # A compiled block's backward is one graph: its weight gradients cannot be deferred (hung).
    ("compiled-zb", r"schedule 'zb-h1' splits backward .* cannot be cut into .*: layers.1. Use a schedule "
                    r"without split backward"),
])
def test_bad_input_fails_on_every_rank_without_hanging(pools, case, message):
    import re

    errors = pools[2].errors(_bad, case)
    assert len(errors) == 2
    assert all(re.search(message, e) for e in errors.values()), errors[0]


def _receives_out_of_send_order() -> list[float]:
    """GPipe whose rank 1 takes microbatch 1 before microbatch 0, on one group per direction (NCCL's
    matching by order), next to plain GPipe: the runtime posts receives in the order rank 0 sends."""
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Action, Kind, make_schedule, pipeline

    s = make_schedule("gpipe", 2, 2)
    row = list(s.actions[1])
    i, j = row.index(Action(Kind.RECV_F, 1, 0)), row.index(Action(Kind.RECV_F, 1, 1))
    row[i], row[j], row[i + 1], row[j + 1] = row[j], row[i], row[j + 1], row[i + 1]
    losses = []
    for rows in (s.actions, [s.actions[0], row]):
        model = plait.init_weights(GPT(GPTConfig(n_layers=2, **CFG)), seed=1)
        pipe = pipeline(model, cached_mesh(pp=2), schedule=[list(r) for r in rows], microbatches=2,
                        loss_fn=lm_loss, p2p="directed")
        losses.append(float(pipe.step(*_batch(0))))
    return losses


def test_receives_listed_out_of_send_order_run_on_one_group_per_direction(pools):
    out = pools[2].run(_receives_out_of_send_order)
    assert out[0] == out[1] and out[0][0] == out[0][1]


def test_one_rank_several_stages_hand_over_locally():
    """pp=1 with 2 chunks: four stages on one rank exchange data locally (no sends or receives),
    and a tie between its first and last stage stays one tensor."""
    import plait
    from plait.models.gpt import GPT, GPTConfig, lm_loss
    from plait.pipeline import Kind, pipeline

    plait.init()
    cfg = GPTConfig(n_layers=2, tie_embeddings=True, **CFG)
    oracle = plait.init_weights(GPT(cfg), seed=0)
    with torch.device("meta"):
        model = GPT(cfg)
    pipe = pipeline(model, plait.Mesh(), schedule="interleaved", chunks=2, microbatches=2, loss_fn=lm_loss)
    assert model.tok_emb.weight is model.lm_head.weight
    assert not any(a.kind in (Kind.SEND_F, Kind.RECV_F) for a in pipe.schedule.actions[0])
    x, y = _batch(0)
    loss = pipe.step(x, y)
    ref = lm_loss(oracle(x), y)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach().double(), **TOL)
    compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, TOL)
