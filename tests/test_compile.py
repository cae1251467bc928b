"""torch.compile on plait models, against one process in float64 at world 2.

Compiled with backend="eager" (Dynamo's graphs, run by eager kernels): what these tests check is
what Dynamo traces and where it breaks the graph, which the backend does not change; inductor
would spend tens of seconds compiling C++ per graph. Graph breaks are counted with
``torch._dynamo.utils.counters["graph_break"]``, by reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from oracle import assert_params_close, loss64
from test_pipeline_parity import CFG, TOL64, _batch

from plait.testing import cached_mesh

DISABLED = "torch.compiler.disable()"  # what Dynamo reports at a function that runs eagerly


def _breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k.splitlines()[0] + " " + next((ln for ln in k.splitlines() if "debug context" in ln), ""): v
            for k, v in counters["graph_break"].items()}


def _fresh() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _train(net: torch.nn.Module, oracle: torch.nn.Module, cut: Callable[[torch.Tensor], torch.Tensor] | None,
           steps: int = 2) -> dict[str, torch.Tensor]:
    """AdamW steps of ``net`` on ``cut`` of each batch (this rank's share; None: all of it) next to
    ``oracle`` on the whole batch."""
    opt, oopt = torch.optim.AdamW(net.parameters()), torch.optim.AdamW(oracle.parameters())
    for step in range(steps):
        x, y = _batch(step, 4)
        loss64(oracle(x), y).backward()
        if cut is not None:
            x, y = cut(x), cut(y)
        loss64(net(x), y).backward()
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    return oracle.state_dict()


def _data_share(mesh=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's share of a batch over ``mesh``'s data-parallel ranks (default: every rank)."""
    if mesh is None:
        r, n = dist.get_rank(), dist.get_world_size()
    else:
        r, n = mesh.rank(("dp", "fsdp")), mesh.size(("dp", "fsdp"))
    return lambda t: t.chunk(n)[r]


def _compile_blocks(model: torch.nn.Module, how: str) -> None:
    """Each block compiled in torch.compile's wrapper (``layers.0._orig_mod.*``) or in place."""
    for i, block in enumerate(model.layers):
        if how == "wrapped blocks":
            model.layers[i] = torch.compile(block, backend="eager")
        elif how == "blocks in place":
            block.compile(backend="eager")


def _assert_state_is(net: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    """The gathered state of ``net`` has exactly ``want``'s names and values."""
    import plait

    assert_params_close(plait.full_state_dict(net), want, **TOL64)


def _gpts():
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layers=2, **CFG)
    return cfg, *(plait.init_weights(GPT(cfg).to(torch.float64), seed=3) for _ in range(2))


def _ddp() -> dict:
    """plait's DDP compiled whole, then torch's on the same model: plait's parity and both counts."""
    import plait

    _, model, oracle = _gpts()
    _fresh()
    net = torch.compile(plait.DDP(model, cached_mesh(dp=2)), backend="eager")
    want = _train(net, oracle, _data_share())
    assert_params_close(plait.full_state_dict(net), want, **TOL64)
    ours = _breaks()
    _, model, oracle = _gpts()
    _fresh()  # one step: every graph and break is made on the first
    torch_ddp = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend="eager")
    _train(torch_ddp, oracle, _data_share(), steps=1)
    return {"plait": ours, "torch": _breaks()}


def test_compiled_ddp_matches_one_process_with_fewer_breaks_than_torch_ddp(pools):
    out = pools[2].run(_ddp)[0]
    plait_n, torch_n = sum(out["plait"].values()), sum(out["torch"].values())
    # The wrapper's own work before and after the module's forward runs eagerly: two clean breaks.
    assert all(DISABLED in k for k in out["plait"]), out["plait"]
    assert plait_n <= torch_n, (out["plait"], out["torch"])


def _tp(how: str, sp: bool = False) -> dict:
    """Tensor parallelism (tp=2, plait.gpt_plan; ``sp``: with sequence parallelism) with the model
    compiled whole after TP, or each block compiled before it: in torch.compile's wrapper
    (``layers.0._orig_mod.*``) or in place."""
    import plait

    cfg, model, oracle = _gpts()
    _fresh()
    _compile_blocks(model, how)
    plait.tensor_parallel(model, cached_mesh(tp=2), plait.gpt_plan(cfg, loss_parallel=False),
                          sequence_parallel=sp)
    net = torch.compile(model, backend="eager") if how == "whole" else model
    want = _train(net, oracle, None)
    _assert_state_is(net, want)  # the uncompiled model's names, gathered over tp
    return _breaks()


@pytest.mark.parametrize("how,sp", [("whole", False), ("whole", True), ("wrapped blocks", False),
                                    ("blocks in place", True)])
def test_compiled_tensor_parallel_matches_one_process_without_graph_breaks(pools, how, sp):
    # plait's tp operators are traced with torch's functional collectives, forward and backward,
    # and a region that draws no random numbers needs no generator swap: no break, as torch's
    # DTensor TP (measured before: 17 compiled whole, 10 per block, one per operator).
    assert pools[2].run(_tp, how, sp)[0] == {}


def _tp_under_fsdp() -> dict:
    """fsdp2 x tp2 (FSDP over TP) with sequence parallelism, compiled whole."""
    import plait

    cfg, model, oracle = _gpts()
    _fresh()
    mesh = cached_mesh(fsdp=2, tp=2)
    net = plait.parallelize(model, mesh, plait.ParallelPlan(tp=plait.gpt_plan(cfg, loss_parallel=False),
                                                            sequence_parallel=True, data="fsdp"))
    want = _train(torch.compile(net, backend="eager"), oracle, _data_share(mesh))
    _assert_state_is(net, want)
    return _breaks()


def test_compiled_tensor_parallel_under_fsdp_breaks_only_at_the_wrapper(pools):
    # FSDP's work around the forward and each unit's runs eagerly; TP's collectives on the tp
    # groups are traced. (dp2 x tp2 measured the same, DDP's breaks only; left out: 11 s.) The
    # eager functions are the wrapper's hooks (`plait.fsdp.hooks.UnitHooks`), named by their class.
    breaks = pools[4].run(_tp_under_fsdp)[0]
    assert breaks and all(DISABLED in k and "UnitHooks." in k for k in breaks), breaks


def _tp_dropout(sp: bool) -> dict:
    """plait's TP with dropout, compiled whole and eager from the same weights and generator
    states: the same gradients, so under compile too each sharded region draws from the per-rank
    stream (eager plait's masks), not the default one that every tp rank shares."""
    import plait
    from plait.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layers=2, dropout=0.25, **CFG)
    grads = []
    for compiled in (False, True):
        model = plait.init_weights(GPT(cfg).to(torch.float64), seed=3)
        plait.tensor_parallel(model, cached_mesh(tp=2), plait.gpt_plan(cfg, loss_parallel=False),
                              sequence_parallel=sp, seed=5, check=False)
        _fresh()
        torch.manual_seed(11)
        net = torch.compile(model, backend="eager") if compiled else model
        x, y = _batch(0, 4)
        loss64(net(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert_params_close(grads[1], grads[0], **TOL64, what="grad")  # compiled against eager
    return _breaks()


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_tensor_parallel_with_dropout_draws_what_eager_draws(pools, sp):
    breaks = pools[2].run(_tp_dropout, sp)[0]
    # Swapping generator states cannot be traced: only those swaps break the graph.
    assert breaks and all(DISABLED in k and "RNGFork" in k for k in breaks), breaks


def _cp(how: str, algorithm: str) -> dict:
    """Context parallelism (cp=2, its gradients averaged by DDP) compiled whole after
    parallelize, or each block compiled before it, two AdamW steps next to one process."""
    import plait

    _, model, oracle = _gpts()
    _fresh()
    _compile_blocks(model, how)
    mesh = cached_mesh(cp=2)
    net = plait.parallelize(model, mesh, plait.ParallelPlan(cp=algorithm, data="ddp", seed=3))
    compiled = torch.compile(net, backend="eager") if how == "whole" else net
    # Each rank's loss is the mean over its tokens; DDP's average over cp makes the whole mean.
    want = _train(compiled, oracle, lambda t: plait.cp.shard(t, mesh))
    _assert_state_is(net, want)
    return _breaks()


@pytest.mark.parametrize("how,algorithm", [("whole", "ring"), ("whole", "allgather"), ("whole", "ulysses"),
                                           ("wrapped blocks", "ring"), ("blocks in place", "ring")])
def test_compiled_context_parallel_matches_one_process(pools, how, algorithm):
    breaks = pools[2].run(_cp, how, algorithm)[0]
    # Each attention module runs eagerly between graphs (its exchanges are point to point, which
    # Dynamo cannot trace): clean breaks only, no failure to trace plait's code.
    assert breaks and all(DISABLED in k for k in breaks), breaks


@pytest.mark.parametrize("how", ["wrapped blocks", "blocks in place"])
def test_zero3_over_compiled_blocks_matches_one_process_without_graph_breaks(pools, how):
    # torchtitan's ways, ``layers[i] = torch.compile(block)`` or ``block.compile()`` first: FSDP's
    # gather and reshard run eagerly around each compiled block (around the wrapper's call, or
    # around the module's compiled call), never inside it; as torch's FSDP2, no graph break.
    assert pools[2].run(_fsdp_compiled, how, 3)[0] == {}


def _fsdp_compiled(how: str, zero_stage: int) -> dict:
    """FSDP compiled whole after wrapping, or over blocks compiled before it: in torch.compile's
    wrapper, or in place (``block.compile()``, whose FSDP hooks then run inside the compiled call)."""
    import plait

    _, model, oracle = _gpts()
    _fresh()
    _compile_blocks(model, how)
    net = plait.FSDP(model, cached_mesh(fsdp=2), zero_stage=zero_stage)
    if how == "whole":
        net = torch.compile(net, backend="eager")
    want = _train(net, oracle, _data_share())
    _assert_state_is(net, want)
    return _breaks()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _fsdp_whole_graphs(zero_stage: int) -> dict[str, int]:
    """Graphs Dynamo makes of plait's FSDP and of torch's FSDP2 (``fully_shard`` per block and
    root; ZeRO-3: resharded after forward) on the same model, each compiled whole, one step."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    _fsdp_compiled("whole", zero_stage)
    ours = _graphs()
    _, model, oracle = _gpts()
    _fresh()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero_stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=zero_stage == 3)
    _train(torch.compile(model, backend="eager"), oracle, _data_share(), steps=1)
    return {"plait": ours, "torch": _graphs()}


@pytest.mark.parametrize("how,zero_stage", [("whole", 3), ("whole", 2), ("whole", 1)])
def test_fsdp_compiled_after_wrapping_matches_one_process(pools, how, zero_stage):
    breaks = pools[2].run(_fsdp_compiled, how, zero_stage)[0]
    # Each unit's gather before its forward and reshard after it run eagerly: clean breaks only.
    assert all(DISABLED in k for k in breaks), breaks


@pytest.mark.parametrize("zero_stage", [3, 2])
def test_fsdp_compiled_whole_splits_no_more_than_fsdp2(pools, zero_stage):
    # torch's FSDP2 runs its hooks eagerly too (Dynamo does not count those as breaks): the
    # measure both share is the number of graphs the model is split into.
    graphs = pools[2].run(_fsdp_whole_graphs, zero_stage)[0]
    assert graphs["plait"] <= graphs["torch"], graphs


def test_checkpointed_compiled_blocks_match_one_process():
    # One process: activation checkpointing finds the blocks compiled in torch.compile's wrapper
    # and checkpoints each (its recomputation runs the compiled forward again).
    import plait
    from plait.compose.activation_checkpointing import checkpointed
    from plait.state.names import plain_name

    _, model, oracle = _gpts()
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="eager")
    plait.activation_checkpointing(model, "full")
    assert [checkpointed(b) for b in model.layers] == ["full", "full"]
    x, y = _batch(0, 2)
    for m in (oracle, model):
        loss64(m(x), y).backward()
    got = {plain_name(n): p.grad for n, p in model.named_parameters()}
    assert_params_close(got, {n: p.grad for n, p in oracle.named_parameters()}, **TOL64, what="grad")


def test_the_random_rates_a_region_swaps_on_are_found_by_name():
    # Under compile a tensor-parallel region swaps to the per-rank stream only if one of these is
    # positive in training mode: dropout layers' p, and float rates named as transformers and
    # plait's models name them.
    from plait.runtime.rng import random_rates

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout, self.scaling, self.resid_pdrop = 0.1, 0.125, 0.0
            self.drop = torch.nn.Dropout(0.2)

    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.jitter_noise, self.top_k = 0.01, 2

    block = torch.nn.ModuleDict({"attn": Attention(), "router": Router()})
    found = {(type(m).__name__, a) for m, a in random_rates(block)}
    assert found == {("Attention", "attention_dropout"), ("Attention", "resid_pdrop"), ("Dropout", "p"),
                     ("Router", "jitter_noise")}
