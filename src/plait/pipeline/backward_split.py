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


def _reaching(roots: Sequence[Node], targets: set[Node]) -> set[Node]:
    """Nodes (from ``roots`` down) from which some node of ``targets`` is reachable."""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:  # iterative post-order: graphs of deep stages exceed Python's recursion limit
        node, expanded = stack.pop()
        kids = [c for c, _ in node.next_functions if c is not None]
        if expanded:
            memo[node] = node in targets or any(memo.get(c, False) for c in kids)
        elif node not in memo:
            memo[node] = False  # placeholder: also breaks revisits while in progress
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in memo)
    return {n for n, hit in memo.items() if hit}


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
    on_path = _reaching(roots, in_nodes)
    to_param = _reaching(roots, set(acc))
    cuts = [n for n in on_path
            if any(c is not None and c in to_param and c not in on_path for c, _ in n.next_functions)]
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
        mine = _params_off_path(n, on_path, acc)
        outs = [GradientEdge(n, k) for k, g in enumerate(gs) if g is not None]
        if mine and outs:
            work.append((outs, [g for g in gs if g is not None], mine))
    # Outputs that do not depend on any input carry their weight gradients entirely in W.
    free = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None and o.grad_fn not in on_path]
    if free:
        work.append(([o for o, _ in free], [g for _, g in free], params))
    return list(got), WeightGrad(work)


def _params_off_path(node: Node, on_path: set[Node], acc: dict[Node, torch.nn.Parameter]) -> list:
    seen: set[Node] = set()
    stack = [c for c, _ in node.next_functions if c is not None and c not in on_path]
    found: dict[int, torch.nn.Parameter] = {}
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if c in acc:
            found[id(acc[c])] = acc[c]
        stack.extend(k for k, _ in c.next_functions if k is not None and k not in on_path)
    return list(found.values())
