"""Every collective in plait goes through this package.

Why one place:

* **Accounting** (`plait.runtime.comm.stats`). ``with comm.counting() as c:`` counts each collective run
  inside the block: its calls, its *logical* bytes (the size of the full tensor reduced or
  gathered) and its *wire* bytes (what one rank sends under the ring algorithm), per collective
  and per mesh axis. Benchmarks compare these with theory: DDP all-reduces Ψ·4 logical bytes per
  step; ZeRO-3 moves 1.5× the wire bytes of DDP.
* **Timeouts that hold** (`plait.runtime.comm.groups`). Every group plait makes (`new_group`) gets
  `plait.init`'s timeout, and is registered under its mesh axis.
* **Desync checks, on by default, and failures that say who** (`plait.runtime.comm.guard`). Before each
  collective the ranks compare a running fingerprint of everything they called on the group; a
  mismatch names every rank's collective, shape, operation and call site, before any data is
  exchanged. A collective that fails or times out raises `CollectiveError` naming the ranks that
  never arrived, and writes this rank's flight record (`plait.runtime.desync`) to the run directory.
* **Device checks** (`plait.runtime.comm.ops`). A tensor on another device than the group's is refused by
  name, so a CPU bookkeeping tensor bound for NCCL fails the same way on CPU.
* **Dry runs** (`plait.runtime.comm.dryrun`). ``with comm.DryRun(mailbox):`` stands this process in for
  one rank of a large world on fake groups (`plait.runtime.env.dry_run` enters it).

The collectives themselves, each a small function that says what moves, are in `plait.runtime.comm.ops`.
The autograd-aware tensor-parallel operators (Megatron's f and g and their sequence-parallel
variants) belong to tensor parallelism: `plait.tp.collectives`.
"""

# The library reaches every name below as `comm.<name>`; `__all__` is the part a user's own loop
# needs (docs/api.md). The rest stays importable here and from its module, unadvertised.
from plait.runtime.comm.dryrun import DryRun, MailNotSent  # noqa: F401
from plait.runtime.comm.groups import (  # noqa: F401
    configure,
    created_groups,
    describe,
    destroy_group,
    device_of,
    group_label,
    is_registered,
    new_group,
    new_local_group,
    on_destroy,
    register_group,
    timeout,
)
from plait.runtime.comm.guard import (  # noqa: F401
    CollectiveError,
    Handle,
    debug,
    desync_check,
    desync_mode,
    operation,
    phase,
    scope,
    verify_history,
    waited,
)
from plait.runtime.comm.ops import (  # noqa: F401
    ReduceOp,
    all_gather_into,
    all_gather_object,
    all_gather_scattered,
    all_reduce,
    all_to_all_into,
    all_to_all_v,
    average_gradients,
    barrier,
    broadcast,
    broadcast_coalesced,
    exchange,
    gathers_by_copy,
    irecv,
    isend,
    recv_object,
    reduce_scatter_consuming,
    reduce_scatter_into,
    reduces_in_place,
    send_object,
)
from plait.runtime.comm.stats import CommStats, counting  # noqa: F401

__all__ = [
    # collectives (plait.runtime.comm.ops)
    "ReduceOp", "all_reduce", "all_gather_into", "reduce_scatter_into", "broadcast", "all_to_all_into",
    "all_gather_object", "barrier", "average_gradients",
    # groups (plait.runtime.comm.groups)
    "new_group", "device_of",
    # counting and the desync guard (plait.runtime.comm.stats, plait.runtime.comm.guard)
    "counting", "CommStats", "debug", "desync_check", "scope", "verify_history", "CollectiveError",
]
