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
  only for the gradients it sends off the input path (its edges towards parameters), so nothing
  of B is recomputed. Then one backward pass from all those edges accumulates every parameter's
  ``.grad`` at once.

The result equals a plain ``backward`` (each parameter's gradient is summed over its cut nodes).
Accumulating in a single pass, rather than one per cut node, matters to data parallelism: each
parameter's post-accumulate hook fires exactly once, and everything the pass accumulates is done
when it ends, as after a plain ``backward``, so DDP's bucket all-reduces and FSDP's
reduce-scatters started by those hooks run during W and are complete when it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

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


Cut = tuple[Node, tuple, list[GradientEdge]]  # node, gradients B saw flowing into it, its off-path edges


class WeightGrad:
    """The deferred W half of one stage-microbatch backward; `run()` accumulates into ``.grad``.

    ``cuts``: each cut node with the gradients B saw flowing into it and its edges off the input
    path; ``roots``/``grads``: edges whose whole subgraph is off the input path (outputs that
    depend on no stage input), run from as they are.
    """

    def __init__(self, cuts: list[Cut], roots: list[GradientEdge], grads: list[torch.Tensor | None],
                 params: list[torch.Tensor]) -> None:
        self._cuts, self._roots, self._grads, self._params = cuts, roots, grads, params

    def run(self) -> None:
        roots, grads = list(self._roots), list(self._grads)
        for node, into, off_path in self._cuts:
            for edge, g in _off_path_grads(node, into, off_path):
                roots.append(edge)
                grads.append(g)
        if roots and self._params:
            # One pass over the off-path subgraphs (they never reach the input path, so nothing is
            # counted twice; shared nodes sum their inputs first): every parameter accumulates once.
            torch.autograd.backward(roots, grads, inputs=self._params)
        self._cuts, self._roots, self._grads = [], [], []  # drops the saved gradients and the graph


def _off_path_grads(node: Node, into: tuple, off_path: list[GradientEdge]
                    ) -> list[tuple[GradientEdge, torch.Tensor]]:
    """The gradients a cut node sends along its off-path edges.

    Asked for those edges, autograd runs only the cut node, skips its input-path output (B's work)
    and stops there. An edge straight into a parameter's accumulator is the exception: capturing
    there would apply the parameter's gradient hooks (tensor parallelism's sum over tp), and the
    accumulating pass would apply them again. For those the node is called directly, which
    recomputes its input-path output too (cheap for the elementwise ops that use a weight
    directly, such as a norm's scale).
    """
    # Edges into AccumulateGrad nodes, with the parameter each accumulates into (its .variable).
    direct = {e: e.node.variable for e in off_path if hasattr(e.node, "variable")}
    later = [e for e in off_path if e not in direct]
    out: list[tuple[GradientEdge, torch.Tensor]] = []
    if later:
        edges = [GradientEdge(node, k) for k, g in enumerate(into) if g is not None]
        got = torch.autograd.grad(edges, later, [g for g in into if g is not None], retain_graph=True,
                                  allow_unused=True)
        out += [(e, g) for e, g in zip(later, got) if g is not None]
    if direct:
        # Concrete autograd nodes are callable; torch's Node stub (an ABC) declares no __call__.
        raw = node(*into)  # type: ignore[operator]
        raw = raw if isinstance(raw, tuple) else (raw,)
        for (child, nr), g in zip(node.next_functions, raw):
            if child is None or g is None:
                continue
            edge = GradientEdge(child, nr)
            if edge in direct:
                var = direct.pop(edge)  # the engine would sum a broadcast gradient to the leaf's shape
                out.append((edge, g.sum_to_size(var.shape).to(var.dtype)))
    return out


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """Run B: return the gradients of ``inputs`` and the pending W for ``params`` (autograd leaves)."""
    params = [p for p in params if p.requires_grad]
    if not inputs:  # first stage: nothing to send upstream, the whole backward is W
        live = [(get_gradient_edge(o), g) for o, g in zip(outputs, grads) if o.grad_fn is not None]
        return [], WeightGrad([], [e for e, _ in live], [g for _, g in live], params)
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    in_nodes = {get_gradient_edge(x).node for x in inputs}
    acc = {get_gradient_edge(p).node for p in params}
    flags, kids = _classify(roots, in_nodes, acc)
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
    work: list[Cut] = []
    for n in cuts:
        gs = saved.get(n)
        if gs is None or all(g is None for g in gs):
            continue
        off = list(dict.fromkeys(GradientEdge(c, i) for c, i in n.next_functions
                                 if c is not None and flags.get(c) == PARAM))
        if off:
            work.append((n, tuple(gs), off))
    # Outputs that do not depend on any input carry their weight gradients entirely in W.
    free = [(get_gradient_edge(o), g) for o, g in zip(outputs, grads)
            if o.grad_fn is not None and not flags.get(o.grad_fn, 0) & IN]
    return list(got), WeightGrad(work, [e for e, _ in free], [g for _, g in free], params)
