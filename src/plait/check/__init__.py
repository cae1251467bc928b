"""Parity of a layout against one process: `plait.check` and `plait check`.

    report = plait.check("mymodels:build", plait.ParallelPlan(data="fsdp"), nproc=2)
    print(report.format()); assert report.ok

The package is callable: ``plait.check(...)`` is `plait.check.check` (`plait.runtime.callable_module`).

How it works, and why this way:

* **Two runs from one factory.** The layout's ranks each build the model from the factory under
  one seed and hand it to `plait.parallelize`; a separate process builds it the same way and
  trains it alone (`plait.check.oracle`). Each step both train on the same global batch, each
  rank on its data-parallel slice. The one-process run gets a process of its own, a world of
  one, rather than a seat on one of the ranks: a model whose computation reads the rank would
  otherwise compute the reference differently on each rank, and the check would miss exactly
  the rank-dependent code it exists to find. It hands its results to the ranks step by step
  through a folder (`plait.check.common.Exchange`). A series of checks can share that process
  (`shared_reference`): it then runs one check's model after the other's.
* **Plain SGD, gradients from updates.** Gradients live in a different form in every layout
  (FSDP flat shards, tensor-parallel shards, pipeline stages on other ranks). With plain SGD the
  update is ``p_after = p_before - lr * grad``, so ``(p_before - p_after) / lr`` is the gradient
  that reached the optimizer, and `plait.full_state_dict` already gives full tensors under the
  original names in every layout. Both runs are read the same way; differences within one
  rounding of the update do not count (`report.update_rounding`: negligible in float64, coarse
  in float32).
* **The culprit module.** A wrong value spreads: forward carries it into every later module,
  backward into the gradients of every earlier layer. So every module's output is compared
  too: forward hooks on the layout's modules (under their original names) against the
  one-process model's outputs on the same slice of the batch (microbatch by microbatch under a
  pipeline), on each rank (`plait.check.probe`). Outputs a rank holds only in part (tensor- or
  sequence-parallel shards) have other shapes and are skipped. The first output past the
  tolerance in forward order, over all ranks, is the culprit, with its rank
  (`report.first_divergence` orders the rest: loss, gradients in backward order, parameters).
* **float64 by default.** Layouts sum in other orders than one process does; in float32 that
  rounding is ~1e-6 and grows, in float64 ~1e-15. Checking in float64 leaves a correct layout
  orders of magnitude under the tolerance and a layout bug far above it. In float32, bfloat16
  and float16 the tolerance is the dtype's error budget (`plait.check.budget`), derived from the
  dtype, the model's sums and the steps.

Limits: every rank holds the full model's state and the reference process the model (use a small
configuration); dropout and other randomness differ between the runs (turn them off in the
factory); a loss that sums over the batch cannot match across data-parallel sizes. Mixed
precision runs in both processes and is held to its compute dtype's budget.
"""

from plait.check import oracle  # noqa: F401 (the reference process's entry point, named in the notes above)
from plait.check.common import CheckInputError, load_factory, next_token_loss  # noqa: F401 (for the CLI)
from plait.check.report import ActivationDiff, CheckReport, Divergence, StepDiff, TensorDiff
from plait.check.run import DEFAULT_TOLERANCE, check, shared_reference  # noqa: F401
from plait.runtime.callable_module import make_callable

__all__ = ["check", "shared_reference", "CheckReport", "CheckInputError", "StepDiff", "TensorDiff",
           "ActivationDiff", "Divergence"]

make_callable(__name__)
