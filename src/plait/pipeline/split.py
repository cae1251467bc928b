"""Cutting a model into pipeline stages by module names.

A model is cut into *segments*: its top-level children in registration order, descending into
every child that holds an `nn.ModuleList`, `nn.Sequential` or `nn.ModuleDict` somewhere below it
(the containers of the blocks: Llama's ``model``, GPT-2's ``transformer``) and flattening those
lists into their elements (not descending into the elements). For plait's GPT that is
``tok_emb, drop, layers.0, ..., layers.N-1, norm, lm_head``; for a Hugging Face
``LlamaForCausalLM`` ``model.embed_tokens, model.layers.0, ..., model.norm, model.rotary_emb,
lm_head``. A stage is a run of consecutive segments. The modules above the
segments hold no parameters of their own (checked): their forwards are glue, which every stage runs
itself (`plait.pipeline.replay`). Their buffers (torchtitan's Llama keeps its rotary table
``freqs_cis`` in the root) are on every stage (`above`), so they must be non-persistent: no stage's
state dict holds them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from plait._torch_compat import compiled_original
from plait.state.names import COMPILED

Segment = tuple[str, nn.Module]
_LISTS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)  # flattened into their elements


def segments(module: nn.Module) -> list[Segment]:
    """The model's ordered segments (see the module's docstring)."""
    return _cut(module)[0]


def above(module: nn.Module) -> list[Segment]:
    """The modules above the segments that own buffers: each stage holds them (their forwards are
    glue, which every stage runs)."""
    return [(n, m) for n, m in _cut(module)[1] if any(b is not None for b in m._buffers.values())]


def _cut(module: nn.Module) -> tuple[list[Segment], list[Segment]]:
    """(the segments, the modules above them) of ``module``."""
    out: list[Segment] = []
    parents: list[Segment] = []

    def visit(prefix: str, mod: nn.Module, in_list: bool) -> None:
        _refuse_compiled(prefix, mod)
        _refuse_own_state(prefix, mod)
        parents.append((prefix[:-1], mod))
        for name, child in mod.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _LISTS):
                visit(full + ".", child, True)
            elif not in_list and _holds_list(child):
                visit(full + ".", child, False)
            else:
                out.append((full, child))

    visit("", module, isinstance(module, _LISTS))
    if not out:
        raise ValueError(f"pipeline: {type(module).__name__} has no child modules to split into stages")
    return out, parents


def _refuse_own_state(prefix: str, mod: nn.Module) -> None:
    """A module above the segments may own no parameter (no stage would train it) and no buffer
    saved with the model (no stage's state dict would hold it)."""
    params = [n for n, p in mod._parameters.items() if p is not None]
    saved = set(mod.state_dict(keep_vars=True)) if mod._buffers else set()
    persistent = [n for n, b in mod._buffers.items() if b is not None and n in saved]
    if not params and not persistent:
        return
    kind = type(mod).__name__
    where = f"{kind} at {prefix[:-1]!r}" if prefix else f"the root module {kind}"
    what = ", ".join([*(f"parameter {n!r}" for n in params),
                      *(f"persistent buffer {n!r}" for n in persistent)])
    raise ValueError(
        f"pipeline: {where} owns {what} but is cut into segments (it holds the list of blocks); its forward "
        "runs on every stage as glue, and every stage holds its buffers, so a parameter must live in a "
        "child module, and a buffer too unless it is recomputed rather than saved "
        "(register_buffer(..., persistent=False), as a rotary table)")


def _refuse_compiled(prefix: str, mod: nn.Module) -> None:
    """A torch.compile'd module above the segments runs its compiled original, bound to the
    original module object: the stages' stand-ins in the replayed tree would never run, and every
    rank would run the whole model itself. Compiling each block in place keeps the tree."""
    original = compiled_original(mod)
    if original is None:
        return
    where = f"{prefix[:-1]!r} is" if prefix else "the model is"
    lists = [n for n, m in original.named_modules() if isinstance(m, _LISTS)]
    example = f"model.{lists[0]}" if lists else "model.layers"
    raise ValueError(
        f"pipeline: {where} torch.compile'd ({type(mod).__name__} around {type(original).__name__}); its "
        "compiled forward would run the whole model on every rank instead of this rank's stages. Pass "
        f"the uncompiled module (`{COMPILED}` of the compiled one) and compile its blocks in place "
        f"first: `for block in {example}: block.compile()`")


def _holds_list(mod: nn.Module) -> bool:
    return any(isinstance(m, _LISTS) for m in mod.modules())


def _param_counts(segs: Sequence[Segment]) -> list[int]:
    seen: set[int] = set()
    counts = []
    for _, mod in segs:
        n = 0
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        counts.append(n)
    return counts


def plan_stages(segs: Sequence[Segment], n_stages: int, split: str | Sequence[str]) -> list[list[int]]:
    """Segment indices of each stage.

    ``split="auto"`` balances parameter counts (minimises the largest stage, exactly, by dynamic
    programming); a list of segment names gives the first segment of stages 1..n_stages-1.
    """
    names = [n for n, _ in segs]
    if n_stages > len(segs):
        raise ValueError(f"pipeline: {n_stages} stages requested but the model has only {len(segs)} "
                         f"segments ({', '.join(names)})")
    if isinstance(split, str):
        if split != "auto":
            raise ValueError(f"split must be 'auto' or a list of segment names starting stages 1.."
                             f"{n_stages - 1}, got {split!r}")
        starts = _balanced_starts(_param_counts(segs), n_stages)
    else:
        split = list(split)
        if len(split) != n_stages - 1:
            raise ValueError(f"split: {n_stages} stages need {n_stages - 1} segment names (the first "
                             f"segment of each stage after the first), got {len(split)}: {split}")
        starts = [0]
        for name in split:
            if name not in names:
                raise ValueError(f"split: {name!r} is not a segment of the model; segments are: "
                                 f"{', '.join(names)}")
            i = names.index(name)
            if i <= starts[-1]:
                raise ValueError(f"split: {name!r} (segment #{i}) must come after the start of the "
                                 f"previous stage ({names[starts[-1]]!r}, segment #{starts[-1]}); "
                                 "stages must be non-empty and in model order")
            starts.append(i)
    bounds = [*starts, len(segs)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(n_stages)]


def _balanced_starts(w: Sequence[int], k: int) -> list[int]:
    n = len(w)
    pre = [0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = float("inf")
    # best[j][i]: smallest possible largest stage when the first i segments form j stages.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for c in range(j - 1, i):
                cost = max(best[j - 1][c], pre[i] - pre[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    starts, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no data copied)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def named_view(segs: Sequence[Segment]) -> nn.Module:
    """A module tree holding ``segs`` (shared, not copied) under their names in the original model.

    ``named_view([("layers.3", blk)])`` has ``blk`` at ``layers.3``, so module-name patterns written
    for the whole model (a tensor-parallel plan's ``layers.*.attn.q_proj``) and per-module init
    names match a pipeline stage's modules. The view is never called.
    """
    root = nn.Module()
    place(root, segs)
    return root


def place(root: nn.Module, segs: Sequence[Segment]) -> None:
    """Register each segment under ``root`` at its dotted name, making plain parents on the way."""
    for name, mod in segs:
        parent = root
        *path, last = name.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent.get_submodule(part)
        parent.add_module(last, mod)


class Stage(nn.Module):
    """Consecutive segments run as a chain, each fed the previous one's output (segment modules are
    shared with the user's model): a stage of a model whose forward is exactly that chain, for
    torch.distributed.pipelining in the benchmarks. `plait.pipeline` runs
    `plait.pipeline.replay.ReplayStage`, which works for any forward.

    The segments are registered under their names in the original model (``layers.3``), so the
    stage's parameter names are the model's: whatever wraps a stage (tensor parallelism's plan
    patterns, FSDP's units and state dicts, per-module initialisation) sees the original names.
    """

    def __init__(self, index: int, segs: Sequence[Segment]) -> None:
        super().__init__()
        # Attribute names a model's children are unlikely to have: the children live beside them.
        self.stage_index = index
        self.segment_names = [n for n, _ in segs]
        self._chain = tuple(m for _, m in segs)  # a tuple: not registered a second time
        place(self, segs)

    def forward(self, *x: Any) -> Any:
        out: Any = x if len(x) > 1 else x[0]
        for seg in self._chain:
            out = seg(*out) if isinstance(out, tuple) else seg(out)
        return out

    @property
    def segments(self) -> list[Segment]:
        """(name in the original model, module) of each segment, in chain order."""
        return list(zip(self.segment_names, self._chain))

    def qualified_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the original model, parameter) for this stage, tied ones once."""
        return list(self.named_parameters())
