"""Splitting one stage's backward into an input-gradient half (B) and a weight-gradient half (W).

Zero-bubble schedules (Qi et al. 2023) send the input gradient upstream as early as possible and
run the weight gradients later, in what would otherwise be pipeline bubbles. With autograd:

* **B.** The graph nodes that lead to the stage inputs form the *input path*. A node on that
  path that also feeds a parameter through nodes off the path (a matmul: its input-gradient
  output stays on the path, its weight-gradient output leaves it) is a *cut node*. B asks
  autograd for the gradients of the stage inputs only, so autograd skips every weight-gradient
  computation (nodes compute only the outputs a requested gradient needs); a pre-hook on each
  cut node keeps the gradient flowing into it.
* **W.** For each cut node, autograd restarts from that node with the saved gradient and is asked
  for the parameters reachable off the input path from it only, so nothing of B is recomputed.

The result equals a plain ``backward`` (each parameter's gradient is summed over its cut nodes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["backward_input", "WeightGrad"]


IN, PARAM = 1, 2  # node flags: an input / a parameter is reachable from the node


def _classify(roots: Sequence[Node], inputs: set[Node], params: set[Node]
              ) -> tuple[dict[Node, int], dict[Node, list[Node]]]:
    """One pass over the graph: each node's IN | PARAM flags, and its children.

    Runs once per B, so it is a single iterative post-order (deep stages exceed Python's
    recursion limit) that reads each node's ``next_functions`` once.
    """
    flags: dict[Node, int] = {}
    kids: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            f = (IN if node in inputs else 0) | (PARAM if node in params else 0)
            for c in kids[node]:
                f |= flags.get(c, 0)
            flags[node] = f
        elif node not in kids:
            ks = kids[node] = [c for c, _ in node.next_functions if c is not None]
            flags[node] = 0  # placeholder until expanded; also stops revisits
            stack.append((node, True))
            stack.extend((c, False) for c in ks if c not in kids)
    return flags, kids


class WeightGrad:
    """The deferred W half of one stage-microbatch backward; `run()` accumulates into ``.grad``."""

    def __init__(self, work: list[tuple[list[GradientEdge | torch.Tensor], list[torch.Tensor],
                                        list[torch.nn.Parameter]]]) -> None:
        self._work = work

    def run(self) -> None:
        for outs, grads, params in self._work:
            got = torch.autograd.grad(outs, params, grads, retain_graph=True, allow_unused=True)
            for p, g in zip(params, got):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._work = []  # drops the saved gradients and, with them, the graph


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor], params: Sequence[torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """Run B: return the gradients of ``inputs`` and the pending W for ``params``."""
    params = [p for p in params if p.requires_grad]
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    if not inputs:  # first stage: nothing to send upstream, the whole backward is W
        return [], WeightGrad([(list(outputs), list(grads), params)])  # type: ignore[list-item]
    in_nodes = {get_gradient_edge(x).node for x in inputs}
    acc = {get_gradient_edge(p).node: p for p in params}
    flags, kids = _classify(roots, in_nodes, set(acc))
    on_path = {n for n, f in flags.items() if f & IN}
    # In graph order, not set order (which follows object addresses): W runs the cuts in this
    # order, and the gradient hooks it fires may communicate (sequence parallelism sums norm
    # weights over tp), so every rank must visit them in the same order.
    cuts = [n for n, f in flags.items() if f & IN and any(flags[c] == PARAM for c in kids[n])]
    saved: dict[Node, tuple] = {}
    hooks = [n.register_prehook(lambda gs, n=n: saved.__setitem__(n, gs)) for n in cuts]
    try:
        got = torch.autograd.grad(list(outputs), list(inputs), list(grads), retain_graph=True,
                                  allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    work: list = []
    for n in cuts:
        gs = saved.get(n)
        if gs is None:
            continue
        mine = _params_off_path(n, on_path, acc, kids)
        outs = [GradientEdge(n, k) for k, g in enumerate(gs) if g is not None]
        if mine and outs:
            work.append((outs, [g for g in gs if g is not None], mine))
    # Outputs that do not depend on any input carry their weight gradients entirely in W.
    free = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None and o.grad_fn not in on_path]
    if free:
        work.append(([o for o, _ in free], [g for _, g in free], params))
    return list(got), WeightGrad(work)


def _params_off_path(node: Node, on_path: set[Node], acc: dict[Node, torch.nn.Parameter],
                     kids: dict[Node, list[Node]]) -> list:
    seen: set[Node] = set()
    stack = [c for c in kids[node] if c not in on_path]
    found: dict[int, torch.nn.Parameter] = {}
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if c in acc:
            found[id(acc[c])] = acc[c]
        stack.extend(k for k in kids.get(c, ()) if k not in on_path)
    return list(found.values())
