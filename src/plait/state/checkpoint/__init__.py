"""Training checkpoints that resume on a different number of ranks, and that cannot lie.

Model and optimizer state are written with `torch.distributed.checkpoint` (each rank writes
what it holds; replicated tensors are stored once) under one key layout for every data
layout::

    {"model": {fqn: tensor}, "optim": {f"{fqn}.{state_key}": tensor}}

FSDP supplies DTensor shards of that layout, tensor parallelism DTensors of its shards (over
the tp group), pipeline ranks the entries of their own stages; DDP, DataParallel and
single-process models supply plain tensors. Because the keys and full shapes are the same, a
checkpoint written by one layout loads into another (ZeRO-3 on 4 ranks -> DDP on 2 -> one
process, or a 2-stage pipeline x tp 2 -> FSDP x tp 2 -> one process).

``plait.json`` beside the data says what the checkpoint is (step, sampler position, config, the
run's identity and layout, plait's version) and lists every file DCP wrote with its size and
sha256 (`plait.state.checkpoint.files` writes it last). A checksum mismatch, a short or missing file,
or a ``plait.json`` that does not parse makes the checkpoint corrupt: `choose` skips it for the
newest good one, and every rank loads what rank 0 chose. `choose` also refuses another run's
checkpoint (by the identity the caller saved). Loading executes no pickled code
(`plait.state.checkpoint.integrity`).

Modules: `protocol` (what each layout saves and loads), `integrity` (checksums, identities,
the safe metadata reader), `files` (save, load, prune), `resume` (choose).
"""

# `check_resumable`, `META` and the integrity helpers are imported for the library and the app, not exported.
from plait.state.checkpoint.files import SaveHandle, latest, load, prune, save
from plait.state.checkpoint.integrity import (  # noqa: F401
    FORMAT,
    META,
    CorruptCheckpoint,
    ForeignCheckpoint,
    SafeReader,
    UnfinishedCheckpoint,
    UnsafeCheckpoint,
    digest,
    file_record,
    identity_differences,
    read_dcp_metadata,
    verify,
)
from plait.state.checkpoint.protocol import load_state_dict, state_dict
from plait.state.checkpoint.resume import NoCheckpoint, check_resumable, choose  # noqa: F401

__all__ = ["save", "load", "latest", "prune", "verify", "choose", "NoCheckpoint", "state_dict",
           "load_state_dict", "SaveHandle", "SafeReader", "CorruptCheckpoint", "UnfinishedCheckpoint",
           "UnsafeCheckpoint", "ForeignCheckpoint"]
