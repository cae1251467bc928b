"""Single-process reference training shared by the strategy tests, and the comparisons every test
of a layout against one process makes through: tensor by tensor (`assert_params_close`,
`compare_with_oracle`, `step_and_compare`, `gaps`), and whole training runs side by side with the
oracle (`train_against_one_process`, `train_cp_against_one_process`,
`train_pipeline_against_one_process`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import plait
from plait.models.gpt import GPT, GPTConfig, lm_loss

TINY = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    model = GPT(GPTConfig(**{**TINY, **overrides}))
    return plait.init_weights(model, seed)


def global_batches(steps: int, batch: int, seq: int = 16, vocab: int = 64, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def loss64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in the logits' dtype: `lm_loss` for float32 and float64 logits (it raises only
    lower precisions to float32)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_single(model: nn.Module, batches: list[torch.Tensor],
                 loss_fn: Callable = lm_loss) -> dict[str, torch.Tensor]:
    opt = make_opt(model.parameters())
    for b in batches:
        opt.zero_grad()
        loss_fn(model(b[:, :-1]), b[:, 1:]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_close(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None],
                        rtol: float = 1e-5, atol: float = 1e-6, *, what: str = "", specs: dict | None = None,
                        held: bool = False, atol_of_max: float = 0.0) -> None:
    """Each tensor of ``got`` (parameters, gradients, buffers, by name) against ``want``'s of the same
    name: the same names (``held``: a subset, what this rank holds), the same tensors within
    ``rtol``/``atol``, plus ``atol_of_max`` times the wanted tensor's largest entry. A tensor-parallel
    shard named in ``specs`` (its `ShardSpec`) is compared with its rows of the full one; a gradient
    that is None must be None on both sides; sparse tensors compare as dense. ``what`` names them
    in a failure."""
    # atol covers entries that are ~0 after weight decay, where relative error is meaningless.
    if held:
        assert set(got) <= set(want), sorted(set(got) - set(want))
    else:
        assert set(got) == set(want), set(got) ^ set(want)
    specs = specs or {}
    for k in got:
        a, b = got[k], want[k]
        label = f"{what} {k}" if what else k
        assert (a is None) == (b is None), f"{label}: got {a}, want {b}"
        if a is None or b is None:
            continue
        if b.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        if k in specs:
            b = specs[k].take(b)
        bound = (atol + atol_of_max * b.abs().max().item()) if atol_of_max else atol
        torch.testing.assert_close(a, b, rtol=rtol, atol=bound, msg=lambda m, k=label: f"{k}: {m}")


def assert_updates_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         start: dict[str, torch.Tensor], rtol: float) -> None:
    """Each tensor's update from ``start``, ``got - start``, against one process's ``want - start``,
    as the L2 norm of their difference relative to that of one process's update: the bound for
    low-precision training, where AdamW moves every element by about its learning rate whatever its
    gradient's size, so an element whose gradient is near zero flips direction under rounding and
    no elementwise bound holds."""
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        step = want[k].float() - start[k].float()
        gap = ((got[k].float() - start[k].float() - step).norm() / step.norm()).item()
        assert gap < rtol, f"{k}: the update is {gap:.3g} of one process's away from it (bound {rtol})"


def full_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gathered in full (a collective: every rank of its mesh calls it); a plain tensor,
    or None, as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Gaps:
    """How far a layout is from one process, measured on every rank and judged where the test
    gathers the ranks' answers: the largest parameter and gradient differences, and the parameters
    whose gradient is None on one side only."""

    param: float = 0.0
    grad: float = 0.0
    none: list[str] = field(default_factory=list)

    def __or__(self, other: Gaps) -> Gaps:
        """The worst of both (over the steps of a run)."""
        return Gaps(max(self.param, other.param), max(self.grad, other.grad), self.none + other.none)

    def within(self, tol: float) -> bool:
        """Every difference at most ``tol``, and no gradient None on one side only."""
        return self.param <= tol and self.grad <= tol and not self.none


def gaps(net: nn.Module, oracle: nn.Module) -> Gaps:
    """`Gaps` between every parameter of ``net`` (gathered in full, DDP's ``module.`` dropped) and
    its gradient, and the same of the one-process ``oracle``, which must have the same parameters."""
    got, want = ({n.removeprefix("module."): p for n, p in m.named_parameters()} for m in (net, oracle))
    assert set(got) == set(want), (sorted(got), sorted(want))
    out = Gaps()
    for n, p in want.items():
        q = got[n]
        out.param = max(out.param, (full_of(q.detach()) - p.detach()).abs().max().item())
        if (q.grad is None) != (p.grad is None):
            out.none.append(n)
        elif p.grad is not None:
            out.grad = max(out.grad, (full_of(q.grad) - p.grad).abs().max().item())
    return out


def step_and_compare(net, oracle: nn.Module, optimizers: tuple, tol: dict, when: str) -> None:
    """Step (and zero) both optimizers, then compare every tensor of ``net``, gathered in full
    whatever its layout, with the single-process ``oracle``'s (``when`` names the step)."""
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    assert_params_close(plait.full_state_dict(net), oracle.state_dict(), **tol, what=f"{when},")


TRAIN_BASE = dict(model="tiny", steps=6, warmup=1, batch_size=8, seq_len=32, eval_every=0, progress=False,
                  max_bytes=200_000, lr=1e-2)
# The same run as `plait train` flags, for tests that launch the command itself.
TRAIN_ARGV = ["--model", "tiny", "--steps", "6", "--warmup", "1", "--batch-size", "8", "--seq-len", "32",
              "--eval-every", "0", "--no-progress", "--max-bytes", "200000", "--lr", "1e-2"]


def train_losses(tmp: str, **layout) -> list[float]:
    """Per-step losses of `plait train`'s loop on a short run (picklable for rank pools)."""
    from plait.app.train import TrainConfig, train

    return train(TrainConfig.from_flags(**{**TRAIN_BASE, "run_dir": tmp, **layout}))["losses"]


def shard_pieces(fsdp):
    """Per parameter of an FSDP module on this rank: (original name, its DTensor parameter, slice of
    the flattened local tensor, slice of the flattened full (tp-local) parameter), for parameters
    this rank holds rows of."""
    for unit in fsdp.units:
        for flat in unit.flats:
            for slot, p in zip(flat.slots, flat.params):
                a, b = slot.rows_of(flat.cfg.rank)
                if a < b:
                    n = (b - a) * slot.row
                    yield slot.fqn, p, slice(0, n), slice(a * slot.row, a * slot.row + n)


def layout_pieces(net):
    """(name in the one-process model, tensor this rank steps, slice of its flattened local tensor,
    slice of the flattened tp-local full parameter) for every parameter of ``net`` on this rank,
    whatever the layout: FSDP's DTensor shards by their rows (a pipeline's FSDP stages too), every
    other parameter whole (slices None; a DDP wrapper's ``module.`` dropped)."""
    from plait.fsdp.wrapper import FullyShardedDataParallel

    parts = list(net.stages.values()) if isinstance(getattr(net, "stages", None), dict) else [net]
    sharded = [part for part in parts if isinstance(part, FullyShardedDataParallel)]
    held = {id(p) for part in sharded for p in part.parameters()}
    for part in sharded:
        yield from shard_pieces(part)
    named = (net.named_parameters(remove_duplicate=False) if isinstance(net, nn.Module)
             else net.named_parameters())  # a Pipeline: each parameter once, under the model's names
    for name, p in named:
        if id(p) not in held:
            yield name.removeprefix("module."), p, None, None


def state_gap(got: Any, want: Any) -> float:
    """The largest difference between two nested states (a model's or an optimizer's state dict:
    dicts, lists and tuples of tensors and plain values; DTensors gathered in full). Dicts must have
    the same keys (asserted); a plain value that differs counts as infinitely far."""
    if isinstance(got, dict):
        assert isinstance(want, dict), f"a dict against {type(want).__name__}"
        assert set(got) == set(want), sorted(set(got) ^ set(want), key=str)  # keys: names or indices
        return max((state_gap(got[k], want[k]) for k in got), default=0.0)
    if isinstance(got, (list, tuple)):
        return max((state_gap(x, y) for x, y in zip(got, want, strict=True)), default=0.0)
    if isinstance(got, torch.Tensor):
        a, b = full_of(got), full_of(want)
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if got == want else float("inf")


def compare_with_oracle(net, oracle: nn.Module, what: str, get: Callable, tol: dict,
                        specs: dict | None = None) -> float:
    """The parity check every layout test makes: ``get`` (a value, a gradient) of each tensor this
    rank steps in ``net`` against the same of the one-process ``oracle``'s parameter, piece by
    piece (``specs``: the tensor-parallel `ShardSpec`s by name; a tp-split tensor is compared with
    its rows of the full one). ``what`` names the moment in a failure. Returns the largest
    difference, for tests that report how close the layout came."""
    specs = specs or {}
    ref = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under each name
    worst = 0.0
    for name, p, mine, theirs in layout_pieces(net):
        full = get(ref[name])
        if mine is None:
            got, want = tp_pair(get(p), full, specs.get(name))
        else:
            got, want = local_of(get(p)).reshape(-1)[mine], piece_of(full, specs.get(name), theirs)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{what} {n}: {m}")
        worst = max(worst, float((got - want).abs().max()) if got.numel() else 0.0)
    return worst


def piece_of(full: torch.Tensor, spec=None, rows: slice | None = None) -> torch.Tensor:
    """What a rank holds of one process's ``full`` tensor, flattened: its tensor-parallel rows by
    ``spec`` (a `ShardSpec`; None: all), then the slice ``rows`` of those (`layout_pieces`' last
    field; None: all)."""
    flat = (spec.take(full) if spec is not None else full).reshape(-1)
    return flat if rows is None else flat[rows]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tp_pair(got: torch.Tensor, full: torch.Tensor, spec=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(got, want) to compare a tensor-parallel model's tensor ``got`` with one process's ``full``:
    a DTensor's full tensor with ``full``; a plain shard with its rows (``spec``, a `ShardSpec`);
    a plain replicated tensor with ``full``."""
    from torch.distributed.tensor import DTensor

    if isinstance(got, DTensor):
        return got.full_tensor(), full
    return got, spec.take(full) if spec is not None else full


# torch 2.6's clip_grad_norm_ on DTensors scales every gradient by a coefficient rounded through
# float32 (measured: 4.9e-8 relative on every gradient of a float64 model, the norm itself exact);
# after 3 AdamW steps that reads 5.8e-7 in the parameters. The pinned torch is exact to 1e-10; the
# versions between were not measured, so they get the older bound.
OLD_DTENSOR_CLIP = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)


def dtensor_clip_tol(tol: dict) -> dict:
    """``tol`` for parameters after torch's clip scaled DTensor gradients (the older bound before 2.13)."""
    return {"rtol": 2e-6, "atol": 1e-9} if OLD_DTENSOR_CLIP else tol


# ------------------------------------------------------------------ training side by side with one process
def logits_of(out: Any) -> torch.Tensor:
    """A model's logits: its output tensor, a dict's ``"logits"``, a `transformers` output's ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if isinstance(out, dict) else out.logits


def _run(model: Callable, inputs: Any) -> torch.Tensor:
    """``model``'s logits on ``inputs``: keyword arguments in a dict, else one positional tensor."""
    return logits_of(model(**inputs) if isinstance(inputs, dict) else model(inputs))


def _rows(inputs: Any, rows: slice) -> Any:
    return {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]


@dataclass
class Trained:
    """What `train_against_one_process` leaves: the model as parallelized (its modules hold this
    rank's pieces), what `plait.parallelize` returned, the oracle after the same steps (trained on
    every rank, or on rank 0 alone) and the layout's state gathered in full."""

    model: nn.Module
    net: nn.Module
    oracle: nn.Module
    full: dict[str, torch.Tensor]


def train_against_one_process(build: Callable[[], nn.Module],
                              batch: Callable[[int], tuple[Any, torch.Tensor]], mesh,
                              plan: Callable[[nn.Module], Any], tol: dict,
                              forward_tol: dict | None = None, *, grads: bool = False, steps: int = 5,
                              every_rank: bool = False, label: str = "") -> Trained:
    """``steps`` AdamW steps (default settings) of the model ``build()`` makes (seeded, the same on
    every rank), parallelized over ``mesh`` by the `plait.ParallelPlan` that ``plan(model)`` gives,
    and of the oracle, one process on the global batch ``batch(step)`` gives (the model's inputs:
    keyword arguments in a dict, else one tensor; the targets of its logits), each data-parallel
    rank (dp, fsdp) on its equal share of the rows. Asserts equal logits at the first step
    (``forward_tol``, default ``tol``), with ``grads`` every parameter's gradient there too (in
    full; tp alone), equal parameters after the last (``tol``, the gathered state against the
    oracle's, name for name), and that training moved them.

    Every rank compares its logits. The gathered state is the same on every rank, so unless
    ``every_rank`` only rank 0 trains the oracle and compares it (and the gradients): the caller
    shows the ranks agree (a digest of `Trained.full`) where that matters."""
    data = ("dp", "fsdp")
    assert not grads or mesh.size(data) == 1, "gradients are compared in full, under tp alone"
    torch.manual_seed(0)  # the same random init on every rank
    oracle = build()
    init = {k: p.detach().clone() for k, p in oracle.named_parameters()}
    model = copy.deepcopy(oracle)
    net = plait.parallelize(model, mesh, plan(model))
    trains_oracle = every_rank or dist.get_rank() == 0
    opt_ref, opt = torch.optim.AdamW(oracle.parameters()), torch.optim.AdamW(net.parameters())
    n, r = mesh.size(data), mesh.rank(data)
    grads_ref: dict[str, torch.Tensor] = {}
    for step in range(steps):
        inputs, tgt = batch(step)
        mine = slice(r * len(tgt) // n, (r + 1) * len(tgt) // n)
        if trains_oracle:
            logits_ref = _run(oracle, inputs)
            loss64(logits_ref, tgt).backward()
            if step == 0:
                grads_ref = {k: p.grad.clone() for k, p in oracle.named_parameters() if p.grad is not None}
            opt_ref.step()
            opt_ref.zero_grad()
        elif step == 0:
            with torch.no_grad():
                logits_ref = _run(oracle, inputs)
        logits = _run(net, _rows(inputs, mine))  # the model's own output, gathered
        loss64(logits, tgt[mine]).backward()
        if step == 0:
            torch.testing.assert_close(logits, logits_ref[mine].detach(), **(forward_tol or tol))
            if grads:  # every rank gathers a tp DTensor's gradient; those that trained the oracle compare
                got = {k: full_of(p.grad) for k, p in net.named_parameters()}
                if trains_oracle:
                    assert_params_close(got, grads_ref, **tol, what=f"{label} grad")
        opt.step()
        opt.zero_grad()
    full = plait.full_state_dict(net)
    if trains_oracle:
        ref = oracle.state_dict()
        assert_params_close(full, ref, **tol, what=label)
        moved = max(float((ref[k] - v).abs().max()) for k, v in init.items())
        assert moved > 1e-4  # training really changed the parameters compared
    return Trained(model, net, oracle, full)


def train_cp_against_one_process(oracle: nn.Module, net: nn.Module, mesh,
                                 batch: Callable[[int], torch.Tensor], tol: dict, label: str = "",
                                 steps: int = 2, lr: float = 0.5) -> None:
    """``steps`` SGD steps of the context-parallel ``net`` and of the one-process ``oracle`` it was
    copied from, on the global batch of token rows ``batch(step)`` gives (inputs and targets its
    shifted halves): this rank's tokens of the logits at the first step, and every parameter after
    each step (`step_and_compare`). ``label`` names the run in a failure."""
    opt_ref, opt = torch.optim.SGD(oracle.parameters(), lr=lr), torch.optim.SGD(net.parameters(), lr=lr)
    for step in range(steps):
        w = batch(step)
        idx, tgt = w[:, :-1], w[:, 1:]
        want = logits_of(oracle(idx))
        loss64(want, tgt).backward()
        got = logits_of(net(plait.cp.shard(idx, mesh)))
        if step == 0:
            torch.testing.assert_close(got, plait.cp.shard(want.detach(), mesh), **tol)
        loss64(got, plait.cp.shard(tgt, mesh)).backward()
        when = f"after SGD step {step + 1}"
        step_and_compare(net, oracle, (opt_ref, opt), tol, f"{label}, {when}" if label else when)


def train_pipeline_against_one_process(pipe, oracle: nn.Module,
                                       batch: Callable[[int], tuple[tuple, torch.Tensor]], loss_fn: Callable,
                                       tol: dict, *, steps: int = 5, specs: dict | None = None) -> float:
    """``steps`` AdamW steps (default settings) of the pipeline ``pipe`` and of the unsplit
    ``oracle`` on the global batch ``batch(step)`` gives (the model's positional inputs, the
    targets): the loss `Pipeline.step` returns at every step, the gradient of every parameter
    this rank holds at the first, and the parameters after the last (a tensor-parallel stage's
    shards by ``specs``), all within ``tol``. Returns the largest difference seen."""
    opt = torch.optim.AdamW([p for _, p in pipe.named_parameters()])
    opt_ref = torch.optim.AdamW(oracle.parameters())
    worst = 0.0
    for step in range(steps):
        x, y = batch(step)
        loss = pipe.step(x, y)
        ref_loss = loss_fn(oracle(*x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), **tol, msg=lambda m, s=step: f"loss {s}: {m}")
        if step == 0:  # same parameters on both sides; later steps compare at drifted points
            worst = compare_with_oracle(pipe, oracle, "gradient of", lambda p: p.grad, tol, specs)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    after = compare_with_oracle(pipe, oracle, f"after {steps} AdamW steps,", lambda p: p.detach(), tol, specs)
    return max(worst, after)
