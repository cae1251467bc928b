"""The one place plait touches private PyTorch and CPython APIs; each use says why no public one fits,
the torch versions it is tested on and the condition for removing it.

"Tested on 2.13": the pinned development torch, by the whole suite. "Tested on 2.6": the floor
``pyproject.toml`` allows, by the part of the suite CI runs on it (docs/testing.md); an entry reached
only by other tests says so. `tests/test_structure.py` fails on a private API used anywhere else.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import nn

# Selective activation checkpointing must see each aten op a block runs (which ones are matmuls,
# what they returned) below autograd, so that its recomputation can be handed the kept outputs;
# torch offers that only as a subclass of this mode (its own selective checkpointing uses it too).
# Imported by every process on 2.6 and 2.13; can go when torch exports the dispatch mode publicly.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """``torch.compiler.disable(fn)`` without importing torch._dynamo.

    torch.compiler.disable imports torch._dynamo as it decorates: about a second of the start of
    every process that imports plait (every rank, every command), compiling or not. This marks a
    plain wrapper of ``fn`` as Dynamo's disable does, with what Dynamo reads and nothing it must
    import: the attributes its tracer checks at a call site (so a compiled region breaks there,
    as at a disabled function), and the wrapper's code set to be skipped by Dynamo's frame
    evaluation, with every frame it calls (so ``fn`` runs eagerly, as under the recursive
    disable). Where this torch lacks that setting, torch.compiler.disable itself. Tested on 2.6 and
    2.13; can go when torch.compiler.disable no longer imports torch._dynamo as it decorates."""
    if _skip_frames is None:
        return torch.compiler.disable(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    _skip_frames(call.__code__)
    functools.update_wrapper(call, fn)
    marks = {"_torchdynamo_disable": True, "_torchdynamo_disable_msg": None,
             "_torchdynamo_disable_recursive": True, "_torchdynamo_orig_callable": fn,
             "_torchdynamo_wrapper_id": id(call)}
    for name, value in marks.items():
        setattr(call, name, value)
    return call  # type: ignore[return-value]


def _frame_skipper() -> Callable[[Any], None] | None:
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # older torch
        return None
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)  # this frame and those it calls
    return lambda code: set_code_exec_strategy(code, skip)


_skip_frames = _frame_skipper()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current ``backward()`` has finished every node.

    DDP needs this to learn that backward is over (to wait for the last bucket and to name
    parameters that never received a gradient). Public hooks fire per tensor or per node;
    only the engine's callback queue fires after the whole graph. Must be called from inside
    a running backward (e.g. from a gradient hook). Tested on 2.6 and 2.13; can go when autograd
    offers a public hook at the end of a backward.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> torch.distributed.Store:
    """The key-value store behind the default process group.

    When a collective fails, each rank posts where it stopped and reads where the others did,
    to name the ranks that never arrived. The group itself is broken by then; the store (a
    separate TCP connection to rank 0's server) still answers, and torch exposes it only here.
    Tested on 2.13 (tests/test_failures.py; the 2.6 run does not reach it); can go when torch
    exposes the default group's store.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile(module)`` wrapped (its ``_orig_mod``), or None when ``module`` is
    not such a wrapper.

    torch.compile returns an ``OptimizedModule`` whose forward runs the compiled original, bound to
    that module object, and exports no public type or predicate for it. `plait.pipeline` must refuse
    one whose forward it would replay (the bound original ignores the stages' stand-ins). Tested on
    2.6 and 2.13; can go when torch exports OptimizedModule or a predicate for it."""
    from torch._dynamo.eval_frame import OptimizedModule

    return module._orig_mod if isinstance(module, OptimizedModule) else None


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs compiled: inside torch.compile's wrapper, or compiled in place by
    ``module.compile()`` (which keeps the module and sets a private compiled call on it). Tested on
    2.6 and 2.13; can go with `compiled_original` and `compiled_call`."""
    return compiled_original(module) is not None or compiled_call(module) is not None


def dcp_load_in_this_process(state: dict[str, Any], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` in this process alone, whatever the process group.

    torch 2.7 added ``no_dist=True`` for this; torch 2.6 has no such argument and loads in one process
    only when no process group is initialized (its documented fallback) or the group is this process
    alone, so there the call is made without it and refused while a group of several ranks is up
    (it would wait for ranks that never call). Public API only; tested on 2.13 (tests/test_export.py);
    can go when the floor is torch 2.7."""
    import inspect
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.load).parameters:
        kwargs["no_dist"] = True
    elif dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("reading a checkpoint in one process while a process group is up needs torch>=2.7 "
                           f"(this is torch {torch.__version__}); read it before plait.init()")
    with warnings.catch_warnings():  # one process is the point here, not a fallback worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, **kwargs)


# ------------------------------------------------------------------ nested inputs and outputs
# torch's pytree knows lists, tuples, dicts, named tuples and every type a library registers
# (transformers registers its ModelOutput classes), which a hand-written walker would not. Tested on
# 2.6 and 2.13; can go when torch's pytree module is public.
def tree_flatten(obj: Any) -> tuple[list[Any], Any]:
    """(leaves, spec) of a nested structure; `tree_unflatten(leaves, spec)` rebuilds it."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(obj)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a nested structure, in order."""
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """The structure with ``fn`` applied to each tensor (other leaves kept)."""
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def register_fake_backend() -> None:
    """Make the ``"fake"`` process-group backend available.

    `plait plan --dry-run` stands one process in for any rank of a world of thousands: every
    group is made and every collective returns at once, touching nothing (the tensors live on
    the meta device). torch ships that backend but registers it only when its testing module
    is imported. Tested on 2.13 (tests/test_plan.py; the 2.6 run does not reach it); can go when
    torch registers the backend without its testing module.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")


def fake_tensors() -> Any:
    """A context in which tensor operations compute shapes, dtypes and devices only, on fake tensors
    (meta tensors and real ones given as inputs are converted on use).

    The tensor-parallel plan check runs a model without data. On plain meta tensors a forward with
    a data-dependent branch fails (transformers' causal mask asks whether the position ids hold
    several packed sequences when there is no cache, as in training); fake tensors are what torch's
    own tracing runs on, and libraries skip such branches for them (transformers'
    ``is_fake_tensor``), as they do under torch.compile. torch exposes them only in
    ``torch._subclasses``. Tested on 2.6 and 2.13; can go when fake tensors are public."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread.

    An activation-checkpointed block's forward runs again inside backward to recompute what it
    saved; a layer that counts its forwards (the MoE balancing statistics) must not count that
    one. torch exposes no public flag for it; the engine's current graph task is -1 outside.
    Tested on 2.6 and 2.13; can go when autograd exposes whether a backward is running.
    """
    return bool(torch._C._current_graph_task_id() != -1)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shapes only, no storage: what torch.compile traces with and
    keeps in its caches), or a wrapper of one. Tested on 2.13 (the memory tracker of `plait plan`;
    the 2.6 run does not reach it); can go with `fake_tensors`."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(t))


def replica_of(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` made as torch's DataParallel makes its replicas (no parameters
    of its own, its buffer and child dicts copied, marked as a replica so ``zero_grad`` warns).

    `plait.DataParallel` replicates as torch's ``replicate`` does, but torch's own refuses CPU
    tensors. Modules override this private method where a plain shallow copy is wrong (RNNs copy
    their flat weight lists, lazy modules refuse), so calling it keeps their behaviour. Tested on
    2.13 (tests/test_data_parallel.py; the 2.6 run does not reach it, torch 2.6 has the method); can
    go when torch's ``replicate`` accepts CPU tensors."""
    return module._replicate_for_data_parallel()


# A tensor subclass that must behave as a plain tensor (a marked gradient, `plait.state.placement.pieces`)
# runs each torch function with subclass dispatch off, so its results are plain tensors: the
# documented default (``super().__torch_function__``) would turn every result into the subclass,
# spreading the mark into optimizer states. torch names no public switch for this. Tested on 2.6 and
# 2.13; can go with the marked gradients, once tp pieces are DTensors for every torch tool.
plain_torch_functions = torch._C.DisableTorchFunctionSubclass


def savable_dtensor(dt: Any) -> Any:
    """``dt`` (a DTensor) rebuilt over the same local tensor with its own storage offset 0.

    A DTensor takes its local tensor's storage offset (torch 2.6 to 2.13); `torch.save` then reads
    a wrapper whose data pointer is not 0 as one with real storage and fails ("invalid python
    storage"). FSDP's local shards are views into one flat vector at non-zero offsets, so the
    values its ``state_dict()`` returns are rebuilt this way: same memory (a `dcp.load` into them
    still loads the model), pickled as DTensors. Tested on 2.6 and 2.13; can go when DTensor ignores
    the local offset."""
    out = torch.Tensor._make_wrapper_subclass(
        type(dt), dt.shape, strides=dt.stride(), storage_offset=0, dtype=dt.dtype, device=dt.device,
        layout=dt.layout, requires_grad=dt.requires_grad)
    out._local_tensor, out._spec = dt._local_tensor, dt._spec
    return out


# ------------------------------------------------------------------ private classes, ops and names

# Classes torch keeps private but every library subclasses or tests against: the common base of
# BatchNorm1d/2d/3d (what `SyncBatchNorm.convert_sync_batchnorm` converts, as torch's own does) and
# of every dropout layer (what `plait.runtime.rng` finds to fork the random stream for). Both resolved at
# import on 2.6 and 2.13; dropout's tested on 2.6 and 2.13 (tensor parallelism's random forks),
# batch norm's on 2.13 (tests/test_sync_batchnorm.py). Can go when torch exports public bases.
BatchNormBase = nn.modules.batchnorm._BatchNorm
DropoutBase = nn.modules.dropout._DropoutNd

# The fused multi-tensor norm torch's own clip_grad_norm_ calls (one kernel per device and dtype);
# `plait.state.placement.pieces` must recognise it among the norms it refuses on pieces. Resolved at import
# on 2.6 and 2.13, the refusal tested on 2.13 (tests/test_torch_tools.py); can go with the refusals,
# once tp pieces are DTensors for every torch tool.
foreach_norm = torch._foreach_norm

# The CPU flash-attention kernels scaled_dot_product_attention dispatches to on CPU (the forward also
# returns the log-sum-exp per row that ring attention merges blocks with, and its backward takes it).
# Context parallelism calls them; `plait plan` gives them a FLOP formula. No public op returns the
# log-sum-exp. Tested on 2.6 and 2.13 (tests/test_context_parallel.py); can go when a public
# attention op returns its log-sum-exp on CPU.
cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# The module torch's Muon optimizer lives in (its public name is torch.optim.Muon, from 2.9): pieces
# refuse the norms it takes of a tp piece's gradient, found by the calling frame's module name. Absent
# on 2.6 (nothing to refuse there), tested on 2.13; must follow torch if the module is renamed, and
# can go with the frame walk (`caller_frame`) once tp pieces are DTensors for every optimizer.
MUON_MODULE = "torch.optim._muon"


def functional_collectives() -> Any:
    """torch's traceable collectives (``torch.distributed._functional_collectives``), which
    torch.compile traces into graphs where plait.comm's bookkeeping cannot be traced; tensor
    parallelism's operators use them. DTensor itself is built on them. Tested on 2.6 and 2.13; can go
    when torch exports them under a public name."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def caller_frame(depth: int) -> FrameType | None:
    """The frame ``depth`` calls above the caller of this function (``depth=0``: the caller's own),
    as ``sys._getframe(depth + 1)``, or None past the outermost.

    plait walks frames to name the user's line a collective came from (desync reports), which library
    code made a tensor without a device (`plait.testing.DeviceAudit`) and which torch module calls a
    norm on a tp piece (`plait.state.placement.pieces`). ``sys._getframe(n)`` skips ``n`` frames in C;
    ``inspect.stack`` reads every frame's source (far too slow per collective). A CPython API, not
    torch's: tested on 2.6 and 2.13 (every collective names its call site); can go for
    ``inspect.currentframe()`` and ``f_back`` if a Python without it must be supported."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:  # fewer frames than asked for
        return None


def set_class(obj: Any, cls: type) -> None:
    """Swap the class of a live object in place (``obj.__class__ = cls``), keeping its identity and
    state: every reference already held sees the new class.

    Used where replacing the object would break what holds it: a module object made callable
    (`plait.runtime.callable_module`), an embedding whose lookup tensor parallelism replaces
    (`plait.tp.styles`, a subclass of its own class made per module), and a DTensor gradient marked
    as a tp piece (the optimizer and ``.grad`` hold it). CPython allows the swap between classes of
    the same layout (torch's tensor subclasses share theirs). Tested on 2.6 and 2.13; can go when
    each has another route (a callable module: PEP 562 covers a module's attributes, not its call;
    the gradient: a DTensor placement torch's tools read)."""
    obj.__class__ = cls


def module_initializing(module: Any) -> bool:
    """Whether ``module`` is being executed right now by an import (importlib sets its spec's
    ``_initializing`` meanwhile). `plait`'s lazy names must not load every name while one of its
    modules is half-run. A CPython API (importlib's own check for circular imports), not torch's:
    tested on 2.6 and 2.13; can go when `plait/__init__` imports its names eagerly."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def drop_library(lib: torch.library.Library) -> None:
    """Remove the kernels ``lib`` registered (torch.library has no public unregister: a Library is
    dropped only with the process, or by its private ``_destroy``). `plait plan` registers a meta
    kernel for the length of a rehearsal. Tested on 2.13 (tests/test_plan.py; the 2.6 run does not
    reach it); can go when torch.library gains a public removal."""
    lib._destroy()


def storage_id(storage: torch.UntypedStorage) -> int:
    """What tells storages apart while both live (its C++ address): views of one storage share it.
    Tested on 2.13 (`plait plan`'s memory tracker; the 2.6 run does not reach it); can go when
    storages expose a public identity."""
    return int(storage._cdata)


def weak_storage_nbytes(ref: Any) -> int:
    """The current size of the storage a ``torch.multiprocessing.reductions.StorageWeakRef`` holds
    (alive: check ``ref.expired()`` first), read without making a strong reference last. How torch's
    own memory tooling reads it. Tested on 2.13 (as `storage_id`); can go when StorageWeakRef has a
    size."""
    return int(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes())


def dtensor_local(t: Any) -> torch.Tensor | None:
    """The local tensor behind a DTensor (or a subclass that wraps one the same way), else None,
    without dispatching (``to_local()`` is an op: inside a dispatch mode it would be seen again).
    Tested on 2.13 (as `storage_id`); can go when DTensor exposes its local tensor without an op."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else None


def wrap_apply(module: nn.Module, wrapper: Callable[..., nn.Module]) -> None:
    """Make ``module._apply(fn, recurse)`` (what ``.to()``, ``.double()``, ``.cuda()`` run on each
    module) call ``wrapper(module, apply, fn, recurse)``, with ``apply`` the class's own, on this
    module object only; once (a second call keeps the first wrapper).

    Tensor parallelism's DTensor parameters are rebuilt around the converted local tensors there,
    and FSDP's wrapper rebuilds its flat groups in the new dtype (`plait.fsdp.conversions`): the
    conversion has no public hook (``register_module_parameter_registration_hook`` sees assignments,
    not conversions). Tested on 2.6 and 2.13 (tests/test_torch_semantics_fsdp.py converts a wrapped
    model); can go when torch's own ``_apply`` converts a DTensor parameter in place (keeping the
    parameter object an optimizer holds)."""
    if "_apply" not in module.__dict__:
        module._apply = functools.partial(wrapper, module, type(module)._apply.__get__(module))  # type: ignore[method-assign]


def unwrap_apply(module: nn.Module) -> None:
    """Undo `wrap_apply` on ``module`` (its class's ``_apply`` again)."""
    module.__dict__.pop("_apply", None)


# The child name under which torch.compile's wrapper (OptimizedModule) holds the module it compiled:
# its state-dict keys and module names carry it (``layers.3._orig_mod.attn``), and torch's own
# state-dict helpers drop it as `plait.state.names` does. Tested on 2.6 and 2.13 (tests/test_state_dict.py
# compiles blocks); must follow torch if OptimizedModule renames it, can go when compiled modules keep
# their original names.
COMPILED_CHILD = "_orig_mod"


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled call ``module.compile()`` set on ``module`` (its forward, compiled, that
    ``module(...)`` runs instead of the plain one), or None when it was not compiled in place.
    Tested on 2.6 (FSDP asks it of every unit) and 2.13 (tests/test_compile.py); can go when torch
    exposes the compiled call or hooks around it."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: nn.Module, call: Callable[..., Any]) -> None:
    """Replace the call ``module.compile()`` set (see `compiled_call`): FSDP gathers and reshards
    around it so that the compiled block stays one graph, as torch's FSDP2 does. Tested on 2.13
    (tests/test_compile.py); can go with `compiled_call`."""
    module._compiled_call_impl = call


def every_optimizer_step(hook: Callable[..., Any], *, after: bool) -> Any:
    """Register ``hook(optimizer, args, kwargs)`` to run before (or ``after``) the step of every
    optimizer in this process, made by plait or not; returns its removable handle.

    Public torch functions (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and ``_post_``),
    but a registry global to the process, shared by every optimizer and every library: kept here so
    that what plait installs there is listed in one place. tp pieces use it to meet an optimizer the
    user made (to give its state dict full tensors); the MoE statistics to learn where a step ends.
    Tested on 2.6 and 2.13 (tensor parallelism's optimizer state) and on 2.13 (tests/test_moe.py);
    can go when tp pieces are DTensors for every optimizer and the MoE statistics are told the step
    by the training loop."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    return (register_optimizer_step_post_hook if after else register_optimizer_step_pre_hook)(hook)


def in_backward_optimizers(p: torch.Tensor) -> list[torch.optim.Optimizer]:
    """The optimizers torch's ``torch.distributed.optim._apply_optimizer_in_backward`` attached to
    ``p`` (kept as ``p._in_backward_optimizers``), [] if none: a user who marks parameters so and
    then wraps in DDP expects DDP to step them after the all-reduce, as torch's DDP does (its own
    ``_setup_in_backward_optimizers`` reads the same attribute). Tested on 2.13
    (tests/test_ddp_in_backward.py); can go when torch makes optimizer-in-backward public."""
    return list(getattr(p, "_in_backward_optimizers", ()))


def take_in_backward_hooks(p: torch.Tensor) -> None:
    """Remove the hooks ``_apply_optimizer_in_backward`` registered on ``p``, which step with the
    local, unreduced gradient; DDP steps the optimizers after each bucket's all-reduce instead, as
    torch's DDP does (through the same module-level map). Tested on 2.13; goes with
    `in_backward_optimizers`."""
    from torch.distributed.optim.apply_optimizer_in_backward import param_to_optim_hook_handle_map

    for handle in param_to_optim_hook_handle_map.get(p, []):
        handle.remove()


# ------------------------------------------------------------------ tensor and module internals
def version_of(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (bumped by every in-place op on its storage), as
    autograd's own saved-tensor check reads it: selective activation checkpointing keeps an output
    only while nothing has written over it or its inputs. Tested on 2.6 and 2.13 (the checkpointing
    tests on 2.13); can go when torch exposes the counter publicly."""
    return int(t._version)


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (shares its base's storage), as autograd tracks it.
    Tensor parallelism copies a view before a custom Function returns it in place of its input.
    Tested on 2.6 and 2.13; can go when torch exposes the view relation publicly (``t._base`` is
    private too)."""
    return bool(t._is_view())


def forward_pre_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward pre-hooks registered on ``module``, in order (torch lists them nowhere publicly):
    activation checkpointing finds tensor parallelism's random-stream hooks among them. Tested on 2.6
    and 2.13; can go when the random streams are recorded on the module by the code that adds them."""
    return list(module._forward_pre_hooks.values())
