"""torch's DDP tests, ported to plait.DDP on 2 Gloo ranks.

Each test names its source in torch's ``torch/testing/_internal/distributed/distributed_test.py``
(``_DistTestBase``) or ``test/distributed/test_c10d_gloo.py`` (``DistributedDataParallelTest``).
Where torch's DDP runs the same pattern on CPU, the test runs torch's DDP beside plait's in the
same pool task, over the same group, from the same float64 model and inputs, and requires the
same gradients (which are None, and the values to 1e-12); elsewhere it compares with one
process. The CUDA/NCCL-only tests and those about torch's internals are listed in NOT_PORTED.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle import assert_params_close
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait.ddp.wrapper import DDP
from plait.testing import cached_mesh

SRC = "torch/testing/_internal/distributed/distributed_test.py::_DistTestBase"
GLOO = "test/distributed/test_c10d_gloo.py::DistributedDataParallelTest"
D = torch.float64
TOL = dict(rtol=0, atol=1e-12)

NOT_PORTED = {
    f"{SRC}::test_DistributedDataParallel_non_default_stream": "CUDA streams",
    f"{SRC}::test_ddp_logging_data_cpu": "torch's DDP logger internals (_get_ddp_logging_data)",
    f"{SRC}::test_ddp_logging_data_gpu": "torch's DDP logger internals, CUDA",
    f"{SRC}::test_ddp_comm_hook_logging": "torch's DDP logger internals",
    f"{SRC}::test_ddp_profiling_autograd_profiler": "the names torch's reducer records in the profiler",
    f"{SRC}::test_ddp_profiling_torch_profiler": "the names torch's reducer records in the profiler",
    f"{SRC}::test_ddp_profiling_execution_trace": "torch's execution trace observer",
    f"{SRC}::test_ddp_bucket_cap_mb_list": "a list of bucket caps is torch-internal; plait takes one cap",
    f"{SRC}::test_ddp_build_debug_param_to_name_mapping": "torch's reducer debug map (internal)",
    f"{SRC}::test_ddp_build_debug_param_to_name_mapping_requires_grad": "torch's reducer debug map",
    f"{SRC}::test_ddp_python_error_logged": "torch's DDP logger",
    f"{SRC}::test_ddp_native_mixed_precision_ignored_params":
        "DDP(mixed_precision=) is torch-internal; plait's mixed precision is plait.mixed_precision",
    f"{SRC}::test_ddp_apply_optim_in_backward": "torch's _apply_optimizer_in_backward is private",
    f"{SRC}::test_ddp_hook_with_optimizer_parity_sgd": "_hook_then_optimizer (private torch API)",
    f"{SRC}::test_ddp_update_process_group_new_group": "torch's private _update_process_group",
    f"{SRC}::test_ddp_remove_autograd_hooks": "torch's private _remove_autograd_hooks",
    f"{SRC}::test_ddp_has_finalized": "torch's reducer internal _check_reducer_finalized",
    f"{SRC}::test_ddp_sink_noclone": "torch's _DDPSink internals (plait applies no sink)",
    f"{SRC}::test_ddp_buffer_hook_allreduce": "torch's private _register_buffer_comm_hook",
    f"{SRC}::test_ddp_broadcast_buffer_via_hook": "torch's private _register_buffer_comm_hook",
    f"{SRC}::test_ddp_compile_static_graph": "compiled autograd with DDP: test_compile covers plait's DDP",
    f"{SRC}::test_ddp_device_mesh_initialization": "torch's DeviceMesh argument; plait takes plait.Mesh",
    f"{GLOO}::test_gloo_backend_1gpu_module_device_ids_integer_list": "CUDA only",
    f"{GLOO}::test_global_local_unused_params_grad": "CUDA half of the test; the CPU half is ported",
    f"{GLOO}::test_ignored_sharded_tensor": "ShardedTensor on CUDA",
    f"{GLOO}::test_save_load_checkpoint": "CUDA only; plait's state_dict round trip is in test_checkpoint",
    f"{GLOO}::test_ddp_comm_hook_future_passing_gpu_gloo": "CUDA half of the CPU test ported",
    f"{GLOO}::test_sparse_gradients_grad_is_view":
        "the argument is refused by name: plait's dense .grad is always a bucket view (torch's True), "
        "sparse gradients never are; test_sparse_gradients' port covers both",
    f"{GLOO}::test_gloo_backend_cpu_module_grad_is_view":
        "the argument is refused by name: plait's .grad is always a bucket view (torch's True), which "
        "test_gloo_backend_cpu_module's port runs with",
    f"{SRC}::test_detect_ddp_is_actually_static": "reads torch's DDP logger (can_set_static_graph)",
    f"{SRC}::test_sync_bn_logged": "torch's DDP logger",
    f"{SRC}::test_ddp_sync_bn_training_vs_eval": "profiler event names of torch's SyncBatchNorm",
    f"{SRC}::test_DistributedDataParallel_with_amp_and_grad_is_view": "CUDA autocast and GradScaler",
    f"{SRC}::test_ddp_hook_with_optimizer_parity_adam": "_hook_then_optimizer (private torch API)",
    f"{SRC}::test_ddp_hook_with_optimizer_parity_adamw": "_hook_then_optimizer (private torch API)",
    f"{SRC}::test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none":
        "DDP(mixed_precision=) is torch-internal; plait.mixed_precision has its own tests",
    f"{SRC}::test_ddp_update_process_group_default_group": "torch's private _update_process_group",
    f"{SRC}::test_ddp_forward_backward_hook": "CUDA only; DDP calls the module as is",
    f"{SRC}::test_ddp_sync_module_states": "torch's private _sync_module_states helper",
    f"{SRC}::test_skip_all_reduce_unused_parameters": "torch's reducer option skip_all_reduce_unused_params",
    f"{SRC}::test_dump_DDP_relevant_env_vars": "prints torch's private _dump_DDP_relevant_env_vars",
    f"{SRC}::test_DistributedDataParallelCPU_grad_is_view":
        "the argument is refused by name: plait's .grad is always a bucket view (torch's True)",
    f"{SRC}::test_get_data_parallel_params": "torch's private _get_data_parallel_params, on CUDA",
    f"{SRC}::test_ddp_apply_optim_in_backward_grad_as_bucket_view_false":
        "torch's private _apply_optimizer_in_backward, on CUDA",
    f"{SRC}::test_ddp_apply_optim_in_backward_ignored_params": "torch's private _apply_optimizer_in_backward",
    f"{SRC}::test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none":
        "DDP(mixed_precision=) on CUDA; plait's mixed precision is plait.mixed_precision (its own tests)",
    f"{SRC}::test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none":
        "DDP(mixed_precision=) on CUDA; plait's mixed precision is plait.mixed_precision (its own tests)",
    f"{SRC}::test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none":
        "DDP(mixed_precision=) on CUDA; plait's mixed precision is plait.mixed_precision (its own tests)",
    f"{SRC}::test_ddp_buffer_hook_allreduce_return_future": "torch's private _register_buffer_comm_hook",
    f"{SRC}::test_ddp_broadcast_buffers_deprecation_warning":
        "a FutureWarning of torch's own DDP argument handling, on CUDA",
    f"{GLOO}::test_gloo_backend_1gpu_module_device_ids_torch_device_list": "CUDA only",
    f"{GLOO}::test_gloo_backend_2gpu_module": "a module spread over 2 GPUs (CUDA only)",
    f"{GLOO}::test_gloo_backend_4gpu_module": "a module spread over 4 GPUs (CUDA only)",
    f"{GLOO}::test_global_local_unused_params_grad_with_grad_is_view":
        "gradient_as_bucket_view, on CUDA; the plain CPU case is ported",
    "test/distributed/test_c10d_gloo.py::ReducerTest::test_forward_backward":
        "drives torch's internal dist.Reducer by hand (prepare_for_forward/backward)",
    "test/distributed/test_c10d_gloo.py::ReducerTest::test_single_dtype_single_bucket":
        "builds torch's internal dist.Reducer with hand-made buckets",
    "test/distributed/test_c10d_gloo.py::ReducerTest::test_multi_dtype_single_bucket":
        "torch's internal dist.Reducer (plait never mixes dtypes in a bucket: test_mixed_dtypes_...)",
    "test/distributed/test_c10d_gloo.py::ReducerTest::test_multi_dtype_multi_bucket":
        "torch's internal dist.Reducer",
}


# ---------------------------------------------------------------------------------------------
# Side by side: the same model under plait's DDP and torch's, same group, same inputs.


def _pair(build, ours_kw: dict | None = None, theirs_kw: dict | None = None, seed: int = 0):
    mesh = cached_mesh(dp=2)
    torch.manual_seed(seed)
    a = build().to(D)
    b = copy.deepcopy(a)
    return (DDP(a, mesh, **(ours_kw or {})),
            TorchDDP(b, process_group=mesh.group("dp"), **(theirs_kw or {})))


def _grads(m: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in m.named_parameters()}


def _state(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(ours: dict, theirs: dict, what: str = "") -> None:
    """plait's tensors by name (gradients that may be None or sparse) against torch's DDP's or one
    process's, within `TOL`."""
    assert_params_close(ours, theirs, **TOL, what=what)


def _x(rank: int, it: int, shape=(3, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * it + rank)
    return torch.randn(*shape, generator=g, dtype=D)


@dataclass
class _Out:
    y: torch.Tensor
    aux: torch.Tensor


class _Net(nn.Module):
    """``b`` is used by choice; ``shape`` picks how the output is returned (the loss reads ``y``:
    a second output made from ``b`` and left out of the loss reaches ``b`` with no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, use_b: bool = True, shape: str = "tensor"):
        h = torch.tanh(self.a(x))
        if use_b and shape == "tensor":
            h = h + self.b(x)
        y = self.c(h)
        if shape == "tensor":
            return y
        aux = self.b(x)
        return {"tuple": (y, aux), "dict": {"y": y, "aux": aux}, "dataclass": _Out(y, aux)}[shape]


def _loss(out) -> torch.Tensor:
    """The first output's; a dataclass's two outputs (torch's DDP walks a dataclass to find unused
    parameters, but its sink cannot pass one through, so an output left out of its loss fails)."""
    if isinstance(out, _Out):
        return out.y.pow(2).sum() + out.aux.sum()
    y = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else out["y"]
    return y.pow(2).sum()


def _drive(model: nn.Module, plan: list, rank: int) -> list[dict]:
    """Run ``plan`` (steps: "zero", or (use_b on rank 0, on rank 1, output shape, no_sync)) and
    snapshot the gradients after each backward."""
    snaps = []
    for it, step in enumerate(plan):
        if step == "zero":
            for p in model.parameters():
                p.grad = None
            continue
        use0, use1, shape, quiet = step
        ctx = model.no_sync() if quiet else _nothing()
        with ctx:
            _loss(model(_x(rank, it), (use0, use1)[rank], shape)).backward()
        snaps.append(_grads(model.module))
    return snaps


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# Grads accumulate across these steps (no zero_grad between), as torch's tests let them.
_UNUSED_PLAN = [
    (True, True, "tensor", False),    # both use b
    (False, True, "tensor", False),   # rank 0 holds b's gradient from before: it contributes it
    (False, False, "tensor", False),  # nobody uses b: its gradient stays as it was
    "zero",
    (False, True, "tensor", False),   # b used on rank 1 only, rank 0 holds none
    (False, False, "tensor", False),  # unused everywhere: b stays at last step's value
    "zero",
    (True, True, "tuple", False),     # b reached only through an output left out of the loss: None
    (True, True, "dict", False),
    (False, False, "dataclass", False),
    (True, True, "tensor", False),
    (True, True, "tuple", False),  # b holds a gradient and gets none: counts as used, as torch
]

_NO_SYNC_PLAN = [
    (True, False, "tensor", True),    # b used on rank 0 only, and only in a no_sync microbatch
    (False, False, "tensor", True),
    (False, False, "tensor", False),  # the reducing step uses b nowhere: usage since the last one counts
    "zero",
    (False, False, "tensor", True),
    (False, True, "tensor", False),
    "zero",
    (False, False, "tuple", True),
    (False, False, "tensor", False),
]


def _find_unused(plan: list) -> dict:
    rank = dist.get_rank()
    ours, theirs = _pair(_Net, {"find_unused_parameters": True}, {"find_unused_parameters": True})
    return {"ours": _drive(ours, plan, rank), "theirs": _drive(theirs, plan, rank)}


@pytest.mark.parametrize("plan", ["accumulated", "no_sync"])
def test_find_unused_parameters_matches_torch(pools, plan):
    """torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_global_local_unused_params_grad
    (CPU half), and distributed_test.py::_DistTestBase::test_output_unused_in_loss_tuple_module,
    ::test_output_unused_in_loss_dict_module, ::test_grads_same_across_ranks_with_no_sync,
    ::test_ddp_control_flow_different_across_ranks (its CPU logic).

    Gradients after every backward equal torch's DDP's on both ranks: an unused parameter
    contributes what it holds, one no rank used since the last reduction keeps .grad (None
    stays None), an output left out of the loss leaves its parameter's .grad None, dataclass
    outputs are walked, and usage in no_sync microbatches counts."""  # noqa: E501
    out = pools[2].run(_find_unused, _UNUSED_PLAN if plan == "accumulated" else _NO_SYNC_PLAN)
    for r in range(2):
        for i, (a, b) in enumerate(zip(out[r]["ours"], out[r]["theirs"], strict=True)):
            _same(a, b, f"rank {r} backward {i}")


class _Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.lin(x)


def _used_outside_forward(wrap: str) -> str:
    mesh = cached_mesh(dp=2)
    torch.manual_seed(0)
    net = _Temperature().to(D)
    model = (DDP(net, mesh, find_unused_parameters=True) if wrap == "plait"
             else TorchDDP(net, process_group=mesh.group("dp"), find_unused_parameters=True))
    try:
        (model(_x(dist.get_rank(), 0)) * net.temperature).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_parameter_used_outside_forward_is_refused_by_name(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_multiple_nested_unused_params_error (the same
    reducer check: a parameter marked unused then given a gradient).

    A parameter used only in the loss (a CLIP-style temperature) is invisible to the walk from the
    forward's outputs: torch raises, and so does plait, naming it (before: its gradient was lost)."""
    theirs = pools[2].run(_used_outside_forward, "torch")
    ours = pools[2].run(_used_outside_forward, "plait")
    assert all("ready only once" in t or "marked" in t for t in theirs), theirs
    assert all("temperature" in o and "outside" in o for o in ours), ours


# ---------------------------------------------------------------------------------------------
# join


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def _uneven(model: nn.Module, steps: int, by_world: bool, **join_kw) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    with model.join(divide_by_initial_world_size=by_world, **join_kw):
        for it in range(steps):
            opt.zero_grad()
            model(_x(rank, it, (5, 4))).pow(2).mean().backward()
            opt.step()
    return _state(model.module)


def _join_bn(steps: list[int], by_world: bool) -> dict:
    ours, theirs = _pair(_BNNet)
    n = steps[dist.get_rank()]
    return {"ours": _uneven(ours, n, by_world), "theirs": _uneven(theirs, n, by_world)}


@pytest.mark.parametrize("by_world", [True, False])
def test_join_with_batchnorm_matches_torch(pools, by_world):
    """torch: distributed_test.py::_DistTestBase::test_ddp_uneven_inputs (its BatchNorm model),
    ::test_ddp_join_model_equivalence, ::test_ddp_uneven_inputs_stop_iteration_sync_bn and
    ::test_ddp_grad_div_uneven_inputs.

    Rank 0 has 2 batches, rank 1 has 4: parameters and BatchNorm running statistics end equal to
    torch's on both ranks and across ranks (before: the buffers were broadcast from rank 0 after it
    joined and never synced at the end)."""
    out = pools[2].run(_join_bn, [2, 4], by_world)
    for r in range(2):
        _same(out[r]["ours"], out[r]["theirs"], f"rank {r}")
    _same(out[0]["ours"], out[1]["ours"], "across ranks")


def _join_options() -> dict:
    rank = dist.get_rank()
    ours, theirs = _pair(_BNNet)
    even = {"ours": _uneven(ours, 2, True, enable=False), "theirs": _uneven(theirs, 2, True, enable=False)}
    errors = {}
    ours, theirs = _pair(_BNNet)
    for name, model in (("theirs", theirs), ("ours", ours)):
        try:
            _uneven(model, 1 + 2 * rank, True, throw_on_early_termination=True)
            errors[name] = "no error"
        except RuntimeError as e:
            errors[name] = str(e)
    return {"even": even, "errors": errors}


def test_join_disabled_and_throw_on_early_termination_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_uneven_input_join_disable and
    ::test_ddp_uneven_input_exception.

    ``join(enable=False)`` on even inputs trains as without it; with
    ``throw_on_early_termination=True`` the rank that ran out and the one still training both
    raise torch's errors."""
    out = pools[2].run(_join_options)
    for r in range(2):
        _same(out[r]["even"]["ours"], out[r]["even"]["theirs"], f"rank {r}")
        assert out[r]["errors"]["ours"] == out[r]["errors"]["theirs"], out[r]["errors"]
    assert "exhausted all inputs" in out[0]["errors"]["ours"]
    assert "Detected at least one rank that exhausted inputs" in out[1]["errors"]["ours"]


def _join_with_zero() -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank = dist.get_rank()
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_BNNet)):
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                      process_group=cached_mesh(dp=2).group("dp"))
        with Join([model, opt]):
            for it in range(1 + 2 * rank):
                opt.zero_grad()
                model(_x(rank, it, (5, 4))).pow(2).mean().backward()
                opt.step()
        res[name] = _state(model.module)
    return res


def test_join_protocol_with_another_joinable_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_uneven_inputs (the Join([ddp, zero]) case of
    test/distributed/optim/test_zero_redundancy_optimizer.py::test_ddp_zero_overlap's join).

    plait's DDP is a torch Joinable: ``Join([ddp, ZeroRedundancyOptimizer])`` over uneven inputs
    ends as torch's DDP with the same optimizer."""
    out = pools[2].run(_join_with_zero)
    for r in range(2):
        _same(out[r]["ours"], out[r]["theirs"], f"rank {r}")


# ---------------------------------------------------------------------------------------------
# create_graph, sparse gradients, undefined gradients


def _create_graph() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(D)
    oracle = copy.deepcopy(net)
    model = DDP(net, cached_mesh(dp=2))

    def penalized(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        y = m(x)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # WGAN-GP's gradient penalty
        return y.mean() + (gx.norm(dim=1) - 1).pow(2).mean()

    with pytest.warns(UserWarning, match="create_graph"):
        penalized(model, _x(rank, 0)).backward(create_graph=True)
    for r in range(2):
        (penalized(oracle, _x(r, 0)) / 2).backward()
    return {"ours": _grads(net), "oracle": _grads(oracle)}


def test_create_graph_backward_matches_one_process(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_create_graph.

    ``backward(create_graph=True)`` over a gradient penalty averages as one process over both
    batches (before: ``div(): functions with out=... arguments don't support automatic
    differentiation``); the averaged gradients carry no graph, and plait warns as torch does."""
    out = pools[2].run(_create_graph)
    for r in range(2):
        _same(out[r]["ours"], out[r]["oracle"], f"rank {r}")


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 6, mode="sum", sparse=True)
        self.emb = nn.Embedding(10, 6, sparse=True)
        self.fc = nn.Linear(6, 3, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bag(ids) + self.emb(ids).sum(1))


def _allreduce_hook_gloo(state, bucket):  # noqa: ANN001, ANN202 (torch's DDP reads string annotations as wrong)
    """torch's test hook: the bucket all-reduced as it comes (sparse too), then divided; ``state`` is
    (the group, a list that records which buckets were sparse)."""
    group, seen = state
    seen.append(bucket.buffer().is_sparse)
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.wait()[0] / dist.get_world_size(group))


def _sparse(find_unused: bool, hook: bool = False) -> dict:
    rank = dist.get_rank()
    kw = {"find_unused_parameters": find_unused}
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_Sparse, kw, kw)):
        seen: list[bool] = []
        if hook:
            model.register_comm_hook((cached_mesh(dp=2).group("dp"), seen), _allreduce_hook_gloo)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        snaps = []
        for it in range(3):
            g = torch.Generator().manual_seed(10 * it + rank)
            ids = torch.randint(0, 10, (4, 3), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(ids), torch.randint(0, 3, (4,), generator=g)).backward()
            snaps.append(_grads(model.module))
            opt.step()
        res[name] = snaps + [_state(model.module)]
        res[f"{name} sparse buckets"] = sum(seen)
    return res


@pytest.mark.parametrize(("find_unused", "hook"), [(False, False), (True, False), (False, True)])
def test_sparse_gradients_match_torch(pools, find_unused, hook):
    """torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_sparse_gradients
    torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_ddp_comm_hook_sparse_gradients

    ``nn.EmbeddingBag(sparse=True)`` and ``nn.Embedding(sparse=True)``: sparse gradients are averaged
    as sparse tensors, equal to torch's DDP's, and SGD steps on them alike (before: ``Cannot access
    data pointer of Tensor that doesn't have storage``); a comm hook gets each sparse gradient as a
    bucket of its own, as torch's does."""  # noqa: E501
    out = pools[2].run(_sparse, find_unused, hook)
    for r in range(2):
        # Each hooked step hands both sparse gradients to the hook, as torch's DDP does.
        assert out[r].pop("ours sparse buckets") == out[r].pop("theirs sparse buckets") == 6 * hook
        for i, (a, b) in enumerate(zip(out[r]["ours"], out[r]["theirs"], strict=True)):
            _same(a, b, f"rank {r} snapshot {i}")
        assert out[r]["ours"][0]["bag.weight"].is_sparse


class _UndefinedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x))


def _undefined_grads() -> dict:
    x = torch.ones(1, 2, dtype=D)
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_UndefinedNet, {"find_unused_parameters": True},
                                                     {"find_unused_parameters": True})):
        torch._C._functions.UndefinedGrad()(model(x).sum()).backward()
        res[name] = _grads(model.module)
    return res


def test_undefined_gradients_leave_grad_none_as_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_undefined_grad_parity_unused_parameters.

    A backward whose gradients are undefined leaves every .grad None, as one process and torch's DDP
    (before: an internal assert)."""
    out = pools[2].run(_undefined_grads)
    for r in range(2):
        assert all(g is None for g in out[r]["ours"].values())
        _same(out[r]["ours"], out[r]["theirs"])


def test_module_without_trainable_parameters_is_refused():
    """torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_requires_grad.

    ``DDP(nn.Module())`` raises before any collective (a single process shows it: no rank waits)."""
    import plait

    plait.init()
    with pytest.raises(RuntimeError, match="no parameter that requires"):
        DDP(nn.Module(), None)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter that requires"):
        DDP(frozen, None)


# ---------------------------------------------------------------------------------------------
# copies


def _copies() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(_BNNet().to(D), cached_mesh(dp=2))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copies = {"deepcopy": copy.deepcopy(model), "saved": loaded, "original": model}
    res = {}
    for name, m in copies.items():
        assert isinstance(m, DDP) and m.group is model.group
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for it in range(2):
            opt.zero_grad()
            m(_x(rank, it, (5, 4))).pow(2).mean().backward()
            opt.step()
        res[name] = _state(m.module)
    return res


def test_deepcopy_and_torch_save_give_working_ddp(pools):
    """torch: torch/nn/parallel/distributed.py::DistributedDataParallel.__getstate__ and __setstate__
    (torch's DDP supports both; its test files hold no CPU test of it: plait's own, against the
    original).

    ``copy.deepcopy`` and ``torch.save``/``torch.load`` of a DDP module give a DDP that trains
    exactly as the original (before: both failed on the process group)."""
    out = pools[2].run(_copies)
    for r in range(2):
        for name in ("deepcopy", "saved"):
            _same(out[r][name], out[r]["original"], f"rank {r} {name}")
    params = {k: v for k, v in out[0]["original"].items() if "running" not in k and "batches" not in k}
    _same(params, {k: out[1]["original"][k] for k in params}, "across ranks")


# ---------------------------------------------------------------------------------------------
# communication hooks


class _HookNet(nn.Module):
    """One matrix and one vector: PowerSGD compresses the first and all-reduces the second, and
    the bucket's order is the same in plait and torch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        return self.lin(x)


def _hook_for(kind: str, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )

    if kind == "allreduce":
        return group, default.allreduce_hook
    if kind == "fp16":
        return group, default.fp16_compress_hook
    if kind == "fp16_wrapper":
        return group, default.fp16_compress_wrapper(default.allreduce_hook)
    if kind == "powerSGD":
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, random_seed=7)
        return state, powersgd.powerSGD_hook
    if kind == "post_localSGD":  # from its 3rd step each rank keeps its own gradient (subgroups of one)
        alone, _ = dist.new_subgroups(group_size=1)
        state = PostLocalSGDState(process_group=group, subgroup=alone, start_localSGD_iter=2)
        return state, post_localSGD_hook
    raise ValueError(kind)


def _hooked(kinds: list[str]) -> dict:
    rank = dist.get_rank()
    group = cached_mesh(dp=2).group("dp")
    res = {}
    for kind in kinds:
        for name, model in zip(("ours", "theirs"), _pair(_HookNet)):
            model.register_comm_hook(*_hook_for(kind, group))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            snaps = []
            for it in range(4):
                opt.zero_grad()
                with model.no_sync() if it == 1 else _nothing():  # one no_sync microbatch
                    model(_x(rank, it, (3, 6))).pow(2).sum().backward()
                if it == 1:
                    model(_x(rank, 9, (3, 6))).pow(2).sum().backward()
                snaps.append(_grads(model.module))
                opt.step()
            res[(kind, name)] = snaps + [_state(model.module)]
    return res


# Left out: bf16_compress_hook (torch's refuses to run without CUDA/NCCL or XPU, whatever the DDP) and
# batched_powerSGD_hook (torch 2.13's hands a 2-D matrix to its own 3-D-only _orthogonalize and fails
# under torch's DDP too).
HOOKS = ["allreduce", "fp16", "fp16_wrapper", "powerSGD", "post_localSGD"]


def test_torch_comm_hooks_run_unchanged_and_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_hook_parity_allreduce,
    ::test_ddp_hook_parity_allreduce_process_group, ::test_ddp_hook_parity_powerSGD,
    ::test_ddp_hook_parity_post_localSGD, ::test_accumulate_gradients_no_sync_allreduce_hook, and
    test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_ddp_comm_hook_allreduce_hook,
    ::test_default_ddp_comm_hooks_fp16, ::test_fp16_compress_wrapper.

    torch's own hooks (default all-reduce, fp16 compression and its wrapper, PowerSGD, post-local
    SGD) run on plait's DDP through its GradBucket and give torch's
    DDP's gradients and parameters at every step, a no_sync microbatch included."""
    out = pools[2].run(_hooked, HOOKS)
    for r in range(2):
        for kind in HOOKS:
            for i, (a, b) in enumerate(zip(out[r][(kind, "ours")], out[r][(kind, "theirs")], strict=True)):
                _same(a, b, f"rank {r} {kind} snapshot {i}")


def _simple_hook(state, bucket: dist.GradBucket) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))
    return fut.then(lambda f: f.value() * 2)


def _hook_contract() -> dict:
    model = _pair(_HookNet)[0]
    errors = {}
    bad = {"not callable": 1, "bucket annotation": _bad_bucket, "return annotation": _bad_return}
    for label, hook in bad.items():
        try:
            model.register_comm_hook(None, hook)
        except (TypeError, ValueError) as e:
            errors[label] = f"{type(e).__name__}: {e}"
    model.register_comm_hook(None, _simple_hook)
    try:
        model.register_comm_hook(None, _simple_hook)
    except RuntimeError as e:
        errors["twice"] = str(e)
    model(_x(0, 0, (3, 6))).sum().backward()
    return {"errors": errors, "grads": _grads(model.module)}


def _bad_bucket(state: object, bucket: int) -> torch.futures.Future:
    return torch.futures.Future()


def _bad_return(state: object, bucket: dist.GradBucket) -> int:
    return 0


def test_comm_hook_contract_as_torch(pools):
    """torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_ddp_comm_hook_future_passing_cpu,
    ::test_ddp_invalid_comm_hook_init, ::test_ddp_invalid_comm_hook_return_type,
    ::test_ddp_comm_hook_register_just_once.

    The gradients are what the hook's future holds (twice a bucket of ones), and registration checks
    as torch's: callable, annotations, once."""  # noqa: E501
    out = pools[2].run(_hook_contract)[0]
    assert out["errors"]["not callable"].startswith("TypeError: ")
    assert "must be callable" in out["errors"]["not callable"]
    assert "bucket annotation should be dist.GradBucket" in out["errors"]["bucket annotation"]
    assert "return annotation should be torch.futures.Future" in out["errors"]["return annotation"]
    assert "can only be called once" in out["errors"]["twice"]
    for g in out["grads"].values():
        torch.testing.assert_close(g, torch.full_like(g, 2.0), **TOL)


# ---------------------------------------------------------------------------------------------
# static_graph, ignored parameters


class _Static(nn.Module):
    """``unused`` never trains; ``mine`` is used on rank 1 only, every step (a static graph per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.mine = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        if dist.get_rank() == 1:
            h = h + self.mine(x)
        return self.out(torch.tanh(h))


def _static_graph() -> dict:
    rank = dist.get_rank()
    res = {}
    kw = {"static_graph": True}
    for name, model in zip(("ours", "theirs"), _pair(_Static, kw, kw)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        snaps = []
        for it in range(4):
            if it != 2:  # one step accumulates on the last
                opt.zero_grad()
            model(_x(rank, it)).pow(2).sum().backward()
            snaps.append(_grads(model.module))
            opt.step()
        res[name] = snaps
    return res


def test_static_graph_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_static_graph_api_cpu and
    test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_global_local_unused_params_grad_with_static_graph
    (CPU half).

    ``static_graph=True``: a parameter no rank uses keeps ``grad=None``, one used on one rank is
    averaged with the other's zeros, over steps that zero and steps that accumulate."""
    out = pools[2].run(_static_graph)
    for r in range(2):
        for i, (a, b) in enumerate(zip(out[r]["ours"], out[r]["theirs"], strict=True)):
            _same(a, b, f"rank {r} step {i}")
        assert out[r]["ours"][-1]["unused.weight"] is None


class _WithIgnored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.own = nn.Linear(4, 4)  # trained by each rank on its own
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        return self.own(torch.tanh(self.a(x)))


def _ignored(how: str) -> dict:
    rank = dist.get_rank()
    names = ["own.weight", "own.bias", "steps"]
    torch.manual_seed(0)
    base = _WithIgnored().to(D)
    with torch.no_grad():  # ranks start apart in what DDP ignores: no broadcast may touch it
        base.own.weight.add_(rank)
        base.steps.fill_(10 * rank)
    theirs_net = copy.deepcopy(base)
    TorchDDP._set_params_and_buffers_to_ignore_for_model(theirs_net, names)
    if how == "keyword":
        ours = DDP(base, cached_mesh(dp=2), params_and_buffers_to_ignore=names)
    else:
        DDP._set_params_and_buffers_to_ignore_for_model(base, names)
        ours = DDP(base, cached_mesh(dp=2))
    theirs = TorchDDP(theirs_net, process_group=cached_mesh(dp=2).group("dp"))
    res = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        for it in range(2):
            model(_x(rank, it)).pow(2).sum().backward()
        res[name] = {**_grads(model.module), **_state(model.module)}
    return res


@pytest.mark.parametrize("how", ["keyword", "torch_static_method"])
def test_ignored_parameters_and_buffers_match_torch(pools, how):
    """torch: distributed_test.py::_DistTestBase::test_ddp_ignore_params_arg.

    Ignored parameters and buffers are neither broadcast nor reduced: each rank keeps its own
    values and local gradients, the rest is averaged, as torch's DDP does."""
    out = pools[2].run(_ignored, how)
    for r in range(2):
        _same(out[r]["ours"], out[r]["theirs"], f"rank {r}")
    assert not torch.equal(out[0]["ours"]["own.weight"], out[1]["ours"]["own.weight"])


def test_unknown_ignored_name_is_refused_before_communication():
    """plait's own (torch accepts any name): a typo in ``params_and_buffers_to_ignore`` would
    silently reduce what it meant to skip, so it is refused by name before any collective."""
    import plait

    plait.init()
    with pytest.raises(ValueError, match="wieght"):
        DDP(nn.Linear(2, 2), None, params_and_buffers_to_ignore=["wieght"])


# ---------------------------------------------------------------------------------------------
# plain behaviour, side by side


class _Tuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return {"h": h, "pair": (self.b(h), h.sum())}


def _accumulate_and_nested() -> dict:
    rank = dist.get_rank()
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_Tuple)):
        snaps = []
        for it in range(4):
            with model.no_sync() if it % 2 == 0 else _nothing():
                out = model(_x(rank, it))
                (out["pair"][0].pow(2).sum() + out["pair"][1]).backward()
            snaps.append(_grads(model.module))
        res[name] = snaps
    return res


def test_no_sync_accumulation_and_nested_outputs_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_accumulate_gradients_no_sync and
    ::test_ddp_namedtuple / ::test_ddp_static_graph_nested_types (nested outputs).

    Gradients accumulated locally under no_sync, then reduced with the next step, equal torch's at
    every step."""
    out = pools[2].run(_accumulate_and_nested)
    for r in range(2):
        for i, (a, b) in enumerate(zip(out[r]["ours"], out[r]["theirs"], strict=True)):
            _same(a, b, f"rank {r} step {i}")


# ---------------------------------------------------------------------------------------------
# reentrant activation checkpointing


class _CheckpointOnce(nn.Module):
    def __init__(self, twice_shared: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)
        self.twice_shared = twice_shared
        if twice_shared:
            self.l1.weight = self.l2.weight

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.l2, self.l1(x), use_reentrant=True)
        return checkpoint(self.l2, h, use_reentrant=True) if self.twice_shared else h


def _reentrant(cases: list[tuple[bool, dict]]) -> dict:
    rank = dist.get_rank()
    res = {}
    for i, (shared, kw) in enumerate(cases):
        for name, model in zip(("ours", "theirs"), _pair(lambda s=shared: _CheckpointOnce(s), kw, kw)):
            snaps = []
            for it in range(3):
                model.zero_grad(set_to_none=False)
                model(_x(rank, it, (3, 6))).pow(2).sum().backward()
                snaps.append(_grads(model.module))
            res[(i, name)] = snaps
    return res


REENTRANT = [(False, {}), (False, {"static_graph": True}), (True, {"static_graph": True})]


def test_reentrant_checkpointing_matches_torch(pools):
    """torch: test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest::test_ddp_checkpointing_once
    and ::test_ddp_checkpointing_twice_weight_sharing (use_reentrant=True; torch runs them on GPUs,
    the logic is the same on CPU).

    Parameters whose gradients arrive inside checkpointing's nested backwards are reduced at the
    end of the step's own backward (before: the nested backward's end ended the step, and the
    parameters after it were missing); with static_graph a weight shared by two checkpointed calls,
    whose gradient arrives twice, is reduced once, after its second."""  # noqa: E501
    out = pools[2].run(_reentrant, REENTRANT)
    for r in range(2):
        for i in range(len(REENTRANT)):
            for s, (a, b) in enumerate(zip(out[r][(i, "ours")], out[r][(i, "theirs")], strict=True)):
                _same(a, b, f"rank {r} case {i} step {s}")


def _reentrant_unused(wrap: str) -> str:
    mesh = cached_mesh(dp=2)
    torch.manual_seed(0)
    net = _CheckpointOnce().to(D)
    model = (DDP(net, mesh, find_unused_parameters=True) if wrap == "plait"
             else TorchDDP(net, process_group=mesh.group("dp"), find_unused_parameters=True))
    try:
        model(_x(dist.get_rank(), 0, (3, 6))).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_reentrant_checkpointing_with_find_unused_is_refused_as_torch(pools):
    """torch: test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest::test_ddp_checkpointing_unused_params.

    Reentrant checkpointing hides its parameters from the walk from the outputs: torch raises, and
    plait raises naming the parameter and the way out (use_reentrant=False or static_graph)."""  # noqa: E501
    theirs = pools[2].run(_reentrant_unused, "torch")
    ours = pools[2].run(_reentrant_unused, "plait")
    assert all("ready only once" in t for t in theirs), theirs
    assert all("parameter l2." in o and "use_reentrant=False" in o for o in ours), ours


# ---------------------------------------------------------------------------------------------
# more of torch's patterns, side by side


def _train_both(build, steps: int, ours_kw=None, theirs_kw=None, loss=None, inputs=None) -> dict:
    """Both wrappers, ``steps`` SGD steps on each rank's inputs; gradients after each backward and
    the final state."""
    rank = dist.get_rank()
    loss = loss or (lambda out: out.pow(2).sum())
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(build, ours_kw, theirs_kw)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        snaps = []
        for it in range(steps):
            opt.zero_grad()
            x = inputs(rank, it) if inputs else _x(rank, it)
            loss(model(x)).backward()
            snaps.append(_grads(model.module))
            opt.step()
        res[name] = snaps + [_state(model.module)]
    return res


def _assert_same_runs(out: list[dict]) -> None:
    for r, res in enumerate(out):
        for i, (a, b) in enumerate(zip(res["ours"], res["theirs"], strict=True)):
            _same(a, b, f"rank {r} snapshot {i}")


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8, bias=False)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def test_basic_training_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_DistributedDataParallelCPU and
    test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_gloo_backend_cpu_module.

    Plain training: gradients at every step and parameters after three SGD steps equal torch's."""
    _assert_same_runs(pools[2].run(_train_both, _Plain, 3))


class _ZeroFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.empty = nn.Linear(4, 0)

    def forward(self, x):
        return self.fc(x).sum(1) + self.empty(x).sum(1)


def test_zero_output_features_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_zero_output_features.

    A layer with no output features (parameters of zero elements) trains beside the others."""
    _assert_same_runs(pools[2].run(_train_both, _ZeroFeatures, 2))


class _NoGradOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4, bias=False)
        self.fc2 = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        y = self.fc2(F.relu(self.fc1(x)))
        return y.detach(), y.clone(), torch.ones(2, dtype=x.dtype), {"new": torch.zeros(1, dtype=x.dtype)}


def _no_grad_outputs() -> dict:
    res = {}
    for i, kw in enumerate([{}, {"find_unused_parameters": True}, {"static_graph": True}]):
        def loss(out):
            assert not out[0].requires_grad and out[2].grad_fn is None
            return (out[0] + out[1]).sum()
        res[i] = _train_both(_NoGradOutput, 3, kw, kw, loss)
    return res


def test_outputs_without_grad_and_new_tensors_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_returns_tensor_with_no_grad,
    ::test_ddp_new_tensor_in_fwd and ::test_ddp_new_tensor_in_fwd_static_graph.

    Outputs that do not require grad (detached, or made in forward) are returned as they are, under
    every option, and the gradients equal torch's."""
    out = pools[2].run(_no_grad_outputs)
    for case in range(3):
        _assert_same_runs([out[r][case] for r in range(2)])


def _ignored_outputs(find_unused: bool) -> dict:
    kw = {"find_unused_parameters": find_unused}
    res = {}
    # with find_unused_parameters, a model whose `temperature` forward never uses
    for name, model in zip(("ours", "theirs"), _pair(_Temperature if find_unused else _Plain, kw, kw)):
        for it in range(3):  # forwards whose outputs are dropped: no backward is owed
            model(_x(0, it))
        snaps = []
        for it in range(3):
            model(_x(dist.get_rank(), it)).pow(2).sum().backward()
            snaps.append(_grads(model.module))
        res[name] = snaps
    return res


@pytest.mark.parametrize("find_unused", [False, True])
def test_ignored_output_matches_torch(pools, find_unused):
    """torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_ignored_output
    and ::test_ignored_output_with_unused_parameters.

    Forwards whose output is dropped owe no backward; training afterwards (with a parameter never
    used, under find_unused_parameters) gives torch's gradients."""
    _assert_same_runs(pools[2].run(_ignored_outputs, find_unused))


class _Shared(nn.Module):
    """One Linear reached through two attributes, and a module unused in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.again = self.shared
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.again(torch.tanh(self.shared(x)))


def test_shared_parameters_with_unused_params_match_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_shared_grad_acc_unused_params.

    A module registered twice, plus an unused one, under find_unused_parameters: torch's gradients."""
    kw = {"find_unused_parameters": True}
    _assert_same_runs(pools[2].run(_train_both, _Shared, 3, kw, kw))


class _ControlFlow(nn.Module):
    """Which layer runs depends on the step (the same on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.step = 0

    def forward(self, x):
        self.step += 1
        return (self.a if self.step % 2 else self.b)(x)


def test_control_flow_same_across_ranks_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_control_flow_same_across_ranks.

    Layers used on alternate steps, on every rank alike, with find_unused_parameters: torch's
    gradients (a layer skipped this step keeps None, having been zeroed)."""
    kw = {"find_unused_parameters": True}
    _assert_same_runs(pools[2].run(_train_both, _ControlFlow, 4, kw, kw))


class _Buffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.seen += x.sum(0)  # differs per rank until DDP broadcasts rank 0's
        return self.fc(x) * 2 + self.seen


def _buffers(broadcast: bool, no_grad_every: int) -> dict:
    rank = dist.get_rank()
    kw = {"broadcast_buffers": broadcast}
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_Buffered, kw, kw)):
        snaps = []
        for it in range(4):
            if no_grad_every and it % no_grad_every == 1:
                with torch.no_grad():
                    model(_x(rank, it, (3, 4)))
            else:
                with model.no_sync() if it == 2 else _nothing():
                    model(_x(rank, it, (3, 4))).sum().backward()
            snaps.append(_state(model.module))
        res[name] = snaps
    return res


@pytest.mark.parametrize("broadcast,no_grad_every", [(True, 0), (True, 2), (False, 0)])
def test_buffer_broadcast_matches_torch(pools, broadcast, no_grad_every):
    """torch: distributed_test.py::_DistTestBase::test_ddp_broadcast_buffer,
    ::test_ddp_inference and ::test_ddp_init_sync_buffers_with_forward_sync_buffers_false.

    Buffers are broadcast from rank 0 before a forward that follows a reducing one (not after a
    no_sync or torch.no_grad() forward), never with broadcast_buffers=False (but once at
    construction): the buffers after every forward equal torch's on each rank."""
    _assert_same_runs(pools[2].run(_buffers, broadcast, no_grad_every))


def _join_options_more(kind: str) -> dict:
    rank = dist.get_rank()
    kw = {"find_unused_parameters": True} if kind == "find_unused" else (
        {"broadcast_buffers": False} if kind == "no_buffers" else {})
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_BNNet, kw, kw)):
        if kind == "hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(cached_mesh(dp=2).group("dp"), default_hooks.allreduce_hook)
        res[name] = [_uneven(model, 1 + 2 * rank, True)]
    return res


@pytest.mark.parametrize("kind", ["find_unused", "hook", "no_buffers"])
def test_join_with_options_matches_torch(pools, kind):
    """torch: distributed_test.py::_DistTestBase::test_ddp_uneven_inputs (its find_unused and
    comm-hook variants) and ::test_ddp_join_respects_forward_sync_buffers_false.

    A rank that joined mirrors the unused-parameter flags and the communication hook's collectives;
    with broadcast_buffers=False the final sync leaves each rank's buffers alone, as torch's."""
    _assert_same_runs(pools[2].run(_join_options_more, kind))


def _differs(what: str) -> None:
    rank = dist.get_rank()
    layers = [nn.Linear(4, 4) for _ in range(1 + rank)]
    net = nn.Linear(4, 4 + rank) if what == "shape" else nn.Sequential(*layers)
    DDP(net, cached_mesh(dp=2))


@pytest.mark.parametrize("what", ["shape", "count"])
def test_models_that_differ_across_ranks_are_refused(pools, what):
    """torch: distributed_test.py::_DistTestBase::test_ddp_model_diff_shape_across_ranks and
    ::test_ddp_model_diff_num_params_across_ranks.

    Every rank raises at construction, naming the first parameter that differs."""
    errors = pools[2].errors(_differs, what)
    assert len(errors) == 2 and all("differs across ranks" in e for e in errors.values()), errors


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))

    def forward(self, x):
        return self.used(x)


def _nested_unused(ignore: bool) -> str:
    names = [n for n, _ in _Nested().named_parameters() if n.startswith("inner.")]
    model = DDP(_Nested().to(D), cached_mesh(dp=2), params_and_buffers_to_ignore=names if ignore else None)
    try:
        model(_x(0, 0)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_unused_parameters_without_detection_are_named(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_multiple_nested_unused_params_error,
    ::test_ddp_multiple_nested_unused_params_err_ignore_params and
    ::test_ddp_unused_params_rebuild_buckets_exception.

    Without find_unused_parameters, nested unused parameters are an error naming each (plait: at
    the end of that backward; torch: at the next forward); ignored, they are no error."""
    out = pools[2].run(_nested_unused, False)
    for text in out:
        assert all(n in text for n in ("inner.0.weight", "inner.1.0.bias"))
        assert "find_unused_parameters" in text
    assert pools[2].run(_nested_unused, True) == ["no error", "no error"]


class _TwoForwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return F.relu(self.lin(x))


def _multi_forward(kw: dict) -> dict:
    rank = dist.get_rank()
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_TwoForwards, kw, kw)):
        snaps = []
        for it in range(3):
            model.zero_grad()
            (model(_x(rank, it)).sum() + model(_x(rank, it + 5)).sum()).backward()
            snaps.append(_grads(model.module))
        res[name] = snaps
    return res


@pytest.mark.parametrize("kw", [{}, {"static_graph": True}], ids=["plain", "static_graph"])
def test_two_forwards_one_backward_match_torch(pools, kw):
    """torch: distributed_test.py::_DistTestBase::test_static_graph_multi_forward.

    Two forwards, one backward of their summed losses: torch's gradients, with and without
    static_graph."""
    _assert_same_runs(pools[2].run(_multi_forward, kw))


class _OnesBranch(nn.Module):
    """Uses ``b`` only for an input of ones: a graph that changes with the data."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if bool((x == 1).all()) else h


def _changing_graph(first_ones: bool) -> str:
    model = DDP(_OnesBranch().to(D), cached_mesh(dp=2), static_graph=True)
    try:
        for i in range(2):
            ones = (i % 2 == 0) == first_ones
            x = torch.ones(3, 4, dtype=D) if ones else _x(dist.get_rank(), i)
            model(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("first_ones", [False, True])
def test_static_graph_that_changes_is_refused(pools, first_ones):
    """torch: distributed_test.py::_DistTestBase::test_invalid_static_graph.

    With static_graph, a parameter the first step did not use getting a gradient later, or one it
    used getting none, raises "your training graph has changed in this iteration", naming it."""
    for text in pools[2].run(_changing_graph, first_ones):
        assert "training graph has changed in this iteration" in text and " b." in text, text


class _Stateless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 1)
        self.register_buffer("buffer", torch.ones(1))

    def forward(self, x):
        return self.l1(x) + self.buffer


def _stateless() -> dict:
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_Stateless)):
        x = torch.full((1, 1), 0.25, dtype=D)
        swapped = {"module.l1.weight": torch.ones(1, 1, dtype=D, requires_grad=True),
                   "module.l1.bias": torch.zeros(1, dtype=D, requires_grad=True),
                   "module.buffer": torch.zeros(1, dtype=D)}
        before = _state(model.module)
        out = torch.func.functional_call(model, swapped, x)
        out.sum().backward()
        model(x).sum().backward()  # and the module's own parameters still train afterwards
        res[name] = [{"out": out.detach(), **{k: v.grad for k, v in swapped.items()}},
                     {k: v for k, v in _state(model.module).items() if not torch.equal(v, before[k])},
                     _grads(model.module)]
    return res


def test_functional_call_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_stateless_api_with_ddp.

    ``torch.func.functional_call`` on the DDP module runs forward with the given tensors, leaves the
    module's own untouched, and their gradients land on the given tensors; the next ordinary
    step reduces as usual."""
    out = pools[2].run(_stateless)
    _assert_same_runs(out)
    assert out[0]["ours"][1] == {}


class _MixedDtypes(nn.Module):
    """fc1 in float64, the rest in float32 (buckets never mix dtypes); fc3 used from step 2 on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False).double()
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)
        self.step = 0

    def forward(self, x):
        self.step += 1
        h = F.relu(self.fc2(F.relu(self.fc1(x)).float()))
        return F.softmax(self.fc3(h) if self.step > 1 else h, dim=1)


def _mixed_dtypes() -> dict:
    rank = dist.get_rank()
    mesh = cached_mesh(dp=2)
    torch.manual_seed(0)
    base = _MixedDtypes()
    res = {}
    for name, model in (("ours", DDP(copy.deepcopy(base), mesh, find_unused_parameters=True)),
                        ("theirs", TorchDDP(copy.deepcopy(base), process_group=mesh.group("dp"),
                                            find_unused_parameters=True))):
        opt = torch.optim.Adam(model.parameters())
        snaps = []
        for it in range(3):
            g = torch.Generator().manual_seed(10 * it + rank)
            opt.zero_grad()
            x, y = torch.rand(5, 2, generator=g, dtype=D), torch.randint(0, 4, (5,), generator=g)
            F.cross_entropy(model(x), y).backward()
            snaps.append(_grads(model.module))
            opt.step()
        res[name] = snaps + [_state(model.module)]
    return res


def test_mixed_dtypes_with_a_late_parameter_match_torch(pools):
    """torch: test/distributed/test_c10d_gloo.py::ReducerTest::test_forward_backward_unused_parameters
    and ::test_forward_backward_optimizer (through DDP rather than torch's internal Reducer).

    float64 and float32 parameters in their own buckets, a parameter unused in the first step only
    (None after it, then trained), Adam zeroing the gradients that are bucket views: torch's
    gradients and parameters (float32 to 1e-6)."""
    out = pools[2].run(_mixed_dtypes)
    for r in range(2):
        for i, (a, b) in enumerate(zip(out[r]["ours"], out[r]["theirs"], strict=True)):
            assert_params_close(a, b, rtol=1e-6, atol=1e-7, what=f"rank {r} step {i}")
        assert out[r]["ours"][0]["fc3.weight"] is None


def _then_hook(state, bucket):  # unannotated: torch reads this module's annotations as strings
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / 2).then(lambda f: f.value() * 0.5)


def _chained_hook() -> dict:
    rank = dist.get_rank()
    res = {}
    for name, model in zip(("ours", "theirs"), _pair(_Plain)):
        model.register_comm_hook(cached_mesh(dp=2).group("dp"), _then_hook)
        snaps = []
        for it in range(3):
            with model.no_sync() if it == 0 else _nothing():
                model(_x(rank, it)).pow(2).sum().backward()
            snaps.append(_grads(model.module))
        res[name] = snaps
    return res


def test_then_chained_hook_with_no_sync_matches_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_accumulate_gradients_no_sync_allreduce_with_then_hook
    and test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_ddp_comm_hook_future_passing_cpu.

    A user hook whose future chains two ``then`` callbacks, after a no_sync microbatch: the
    gradients are the chain's result, as torch's."""  # noqa: E501
    _assert_same_runs(pools[2].run(_chained_hook))


def _sparse_ids(rank: int, it: int) -> torch.Tensor:
    return torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(10 * it + rank))


def _join_sparse(find_unused: bool) -> dict:
    rank = dist.get_rank()
    model = _pair(_Sparse, {"find_unused_parameters": find_unused})[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for it in range(1 + 2 * rank):
            opt.zero_grad()
            model(_sparse_ids(rank, it)).pow(2).mean().backward()
            opt.step()
    return _state(model.module)


@pytest.mark.parametrize("find_unused", [False, True])
def test_join_with_sparse_gradients_matches_one_process(pools, find_unused):
    """torch: distributed_test.py::_DistTestBase::test_ddp_uneven_inputs (with
    test_c10d_gloo.py::DistributedDataParallelTest::test_sparse_gradients's kind of model; torch's
    own join fails there, its joined rank having no zero bucket for a sparse gradient).

    A rank that joined answers the sparse all-reduces with empty sparse gradients: both ranks end
    as one process stepping on the batches of the ranks still training, divided by the world."""
    out = pools[2].run(_join_sparse, find_unused)
    torch.manual_seed(0)
    oracle = _Sparse().to(D)
    opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for it in range(3):
        opt.zero_grad()
        live = [r for r in range(2) if it < 1 + 2 * r]
        (sum(oracle(_sparse_ids(r, it)).pow(2).mean() for r in live) / 2).backward()
        opt.step()
    for r in range(2):  # the sum over ranks is in another order than the oracle's: 1e-12, not bitwise
        assert_params_close(out[r], _state(oracle), rtol=1e-12, atol=1e-12, what=f"rank {r}")


def _hook_pickling() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Linear(1, 5).to(D)
    x, y = _x(rank, 0, (7, 1)), _x(rank, 1, (7, 5))

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    model = DDP(copy.deepcopy(net), cached_mesh(dp=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=4)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    train(model, opt, 10)
    buf = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "comm_hook": powersgd.powerSGD_hook,
                "comm_hook_state": state}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    again = DDP(copy.deepcopy(net), cached_mesh(dp=2))
    again.load_state_dict(saved["state_dict"])
    again.register_comm_hook(saved["comm_hook_state"], saved["comm_hook"])
    opt_again = torch.optim.SGD(again.parameters(), lr=0.01)
    train(model, opt, 5)
    train(again, opt_again, 5)
    return {"original": _state(model.module), "loaded": _state(again.module),
            "state": {k: getattr(saved["comm_hook_state"], k) == getattr(state, k)
                      for k in ("matrix_approximation_rank", "start_powerSGD_iter", "iter")}}


def test_comm_hook_state_pickling_as_torch(pools):
    """torch: distributed_test.py::_DistTestBase::test_ddp_hook_pickling_powerSGD.

    A DDP's state dict, torch's PowerSGD hook and its state saved with torch.save and loaded into a
    new DDP train on exactly as the original (the state's process group is dropped and becomes
    the default one, as torch's PowerSGDState does)."""
    for out in pools[2].run(_hook_pickling):
        _same(out["loaded"], out["original"])
        assert all(out["state"].values()), out["state"]


def test_torch_only_arguments_are_refused_by_name_before_communication():
    """torch: distributed_test.py::_DistTestBase::test_ddp_device (device_ids / output_device, which
    plait's DDP does not take: refused by name with what to write instead).

    ``device_ids``, ``process_group``, ``gradient_as_bucket_view`` and other torch-only arguments
    raise a TypeError naming each and its replacement, before any collective; a misspelt option
    too."""
    import plait

    plait.init()
    with pytest.raises(TypeError, match=r"device_ids: .*module is.*process_group: pass mesh="):
        DDP(nn.Linear(2, 2), None, device_ids=[0], process_group=None)
    with pytest.raises(TypeError, match="gradient_as_bucket_view"):
        DDP(nn.Linear(2, 2), None, gradient_as_bucket_view=False)
    with pytest.raises(TypeError, match="find_unused_paramters: not an argument"):
        DDP(nn.Linear(2, 2), None, find_unused_paramters=True)


# ---------------------------------------------------------------------------------------------
# torch's DDP + SyncBatchNorm tests (CUDA-only there: torch's nn.SyncBatchNorm refuses CPU
# tensors), with plait.SyncBatchNorm on Gloo against one process on the global batch.


class _BatchNormNet(nn.Module):
    """torch's BatchNormNet: fc1, a BatchNorm1d over 4 channels of 10, fc2, softmax."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.fc1(x).reshape(-1, 4, 10)).reshape(-1, 40)
        return F.softmax(self.fc2(x), dim=1)


def _sync_bn_parity(build, shape: tuple[int, ...], sizes: list[int], iters: int, out: tuple[int, ...],
                    memory_format: torch.memory_format = torch.contiguous_format) -> float:
    """Train ``build()`` with SyncBatchNorm under DDP (rank r holds ``sizes[r]`` rows of the global
    batch) and alone on the global batch; the largest difference of parameters and buffers."""
    from plait.compose.sync_batchnorm import SyncBatchNorm

    mesh, rank = cached_mesh(dp=2), dist.get_rank()
    torch.manual_seed(0)
    ref = build().to(D)
    ddp = DDP(SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref), mesh), mesh)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ddp, ref)]
    total, at = sum(sizes), sum(sizes[:rank])
    worst = 0.0
    for it in range(iters):
        g = torch.Generator().manual_seed(it)
        x = torch.randn(total, *shape, generator=g, dtype=D).to(memory_format=memory_format)
        y = torch.randn(total, *out, generator=g, dtype=D)
        mine, want = x[at:at + sizes[rank]], y[at:at + sizes[rank]]
        # The mean over the global batch: DDP averages the ranks' gradients, whatever their shares.
        ((ddp(mine) - want) ** 2).sum().mul(2 / (total * want[0].numel())).backward()
        F.mse_loss(ref(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        got, want_state = ddp.module.state_dict(), ref.state_dict()
        assert list(got) == list(want_state), (list(got), list(want_state))
        for k, v in want_state.items():
            worst = max(worst, (got[k].double() - v.double()).abs().max().item())
    return worst


def _sync_bn_cases() -> dict:
    from plait.compose.sync_batchnorm import SyncBatchNorm

    mesh, rank = cached_mesh(dp=2), dist.get_rank()
    out = {
        "affine": _sync_bn_parity(_BatchNormNet, (2,), [2, 2], 5, (4,)),
        "no_affine": _sync_bn_parity(lambda: _BatchNormNet(affine=False), (2,), [2, 2], 2, (4,)),
        "2d_input": _sync_bn_parity(lambda: nn.BatchNorm1d(2), (2,), [2, 2], 5, (2,)),
        "single_input_per_process": _sync_bn_parity(lambda: nn.BatchNorm1d(2), (2,), [1, 1], 5, (2,)),
        "diff_input_sizes_gradient": _sync_bn_parity(_BatchNormNet, (2,), [2, 3], 5, (4,)),
        "channels_last": _sync_bn_parity(lambda: nn.BatchNorm2d(2, momentum=0.99), (2, 4, 4), [2, 2], 5,
                                         (2, 4, 4), torch.channels_last),
    }
    # Different input sizes per rank: the running statistics are the global batch's.
    bn = DDP(SyncBatchNorm(2, momentum=0.99, mesh=mesh).to(D), mesh)
    inputs = [torch.cat([torch.ones(2, 1, 10 ** (i + 1), dtype=D) * 0.1 ** (i - 1),
                         torch.ones(2, 1, 10 ** (i + 1), dtype=D) * 0.3 ** (i - 1)], dim=1) for i in range(2)]
    every = torch.cat([x.permute(1, 0, 2).reshape(2, -1) for x in inputs], dim=1)
    for _ in range(10):
        bn(inputs[rank]).mean().backward()
    out["running_value"] = max((bn.module.running_mean - every.mean(1)).abs().max().item(),
                               (bn.module.running_var - every.var(1)).abs().max().item())
    # Half precision: forward and backward in fp16, gradients fp16.
    torch.manual_seed(0)
    half = DDP(SyncBatchNorm.convert_sync_batchnorm(_BatchNormNet().half(), mesh), mesh)
    y = half(torch.randn(2, 2, dtype=torch.float16))
    y.sum().backward()
    out["half"] = (y.dtype, {p.grad.dtype for p in half.parameters()})
    return out


def test_sync_batchnorm_under_ddp_matches_one_process(pools):
    """torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_No_Affine
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_2D_Input
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_Channels_Last
    torch: distributed_test.py::_DistTestBase::test_DistributedDataParallel_SyncBatchNorm_half

    (CUDA-only in torch, whose nn.SyncBatchNorm refuses CPU tensors.) ``convert_sync_batchnorm``
    under plait's DDP trains as one process on the global batch in float64 (parameters and running
    statistics to 1e-12): affine or not, 2-D input, one row per rank, 2 and 3 rows on the two ranks,
    channels-last 4-D input; ranks with inputs of different lengths give the global batch's running
    mean and (unbiased) variance; fp16 runs forward and backward with fp16 gradients."""  # noqa: E501
    for out in pools[2].run(_sync_bn_cases):
        half = out.pop("half")
        assert half == (torch.float16, {torch.float16}), half
        assert all(v <= 1e-12 for v in out.values()), out


class _Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x


class _AllUsedOnRank0(nn.Module):
    """torch's FindUnusedParamModule: rank 0 uses both tasks, rank 1 only t1."""

    def __init__(self) -> None:
        super().__init__()
        self.t0, self.t1 = _Task(), _Task()

    def forward(self, x, rank: int):
        return self.t1(self.t0(x)) if rank == 0 else self.t1(x)


def _unused_empty_on_one_rank() -> dict:
    rank = dist.get_rank()
    out = {}
    for name, model in zip(("ours", "theirs"), _pair(_AllUsedOnRank0, {"find_unused_parameters": True},
                                                        {"find_unused_parameters": True}), strict=True):
        before = [p.grad for p in model.module.parameters()]
        model(8, rank).mean().backward()
        out[name] = (before, _grads(model.module))
    return out


def test_find_unused_parameters_when_unused_parameters_empty_matches_torch(pools):
    """torch: test/distributed/test_c10d_gloo.py::DistributedDataParallelTest::test_find_unused_parameters_when_unused_parameters_empty

    (The CPU half.) With find_unused_parameters=True, a rank that used every parameter (none
    unused there) still takes part in reducing the one another rank left unused: both parameters
    get gradients on both ranks, equal to torch's DDP."""  # noqa: E501
    for out in pools[2].run(_unused_empty_on_one_rank):
        assert out["ours"][0] == [None, None] == out["theirs"][0]
        assert all(g is not None for g in out["ours"][1].values()), out
        _same(out["ours"][1], out["theirs"][1])
