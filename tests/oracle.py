"""Single-process reference training shared by the strategy tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
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


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        rtol: float = 1e-5, atol: float = 1e-6) -> None:
    # atol covers entries that are ~0 after weight decay, where relative error is meaningless.
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def step_and_compare(net, oracle: nn.Module, optimizers: tuple, tol: dict, when: str) -> None:
    """Step (and zero) both optimizers, then compare every tensor of ``net``, gathered in full
    whatever its layout, with the single-process ``oracle``'s (``when`` names the step)."""
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    full = plait.full_state_dict(net)
    for name, want in oracle.state_dict().items():
        torch.testing.assert_close(full[name], want, **tol, msg=lambda m, n=name: f"{when}, {n}: {m}")


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


def compare_with_oracle(net, oracle: nn.Module, what: str, get: Callable, tol: dict,
                        specs: dict | None = None) -> None:
    """The parity check every layout test makes: ``get`` (a value, a gradient) of each tensor this
    rank steps in ``net`` against the same of the one-process ``oracle``'s parameter, piece by
    piece (``specs``: the tensor-parallel `ShardSpec`s by name; a tp-split tensor is compared with
    its rows of the full one). ``what`` names the moment in a failure."""
    specs = specs or {}
    ref = dict(oracle.named_parameters(remove_duplicate=False))  # a tied weight under each name
    for name, p, mine, theirs in layout_pieces(net):
        full = get(ref[name])
        if mine is None:
            got, want = tp_pair(get(p), full, specs.get(name))
        else:
            got = local_of(get(p)).reshape(-1)[mine]
            want = (specs[name].take(full) if name in specs else full).reshape(-1)[theirs]
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{what} {n}: {m}")


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
