"""The names plait's FSDP shows in state dicts: the model's own, as torch's FSDP1 and FSDP2 show them.

The wrapper holds the model as its ``module`` child (so ``named_parameters()`` reads
``module.<name>``, as DDP's), but a state dict is a file format: FSDP2 (which wraps nothing) and
FSDP1 (which strips its wrapper's prefix) both write the model's own names, loadable into the
unwrapped model as they are. These hooks drop the ``module.`` level from ``state_dict()`` and put
it back before ``load_state_dict()`` reads the keys; ``_fqn_modifiers`` tells
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``) the same thing.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from plait._torch_compat import savable_dtensor

WRAPPED = "module"  # the wrapper's attribute holding the model


def own_names(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: ``<prefix>module.<name>`` becomes ``<prefix><name>``, in order, and each
    DTensor value is made savable by `torch.save` (`plait._torch_compat.savable_dtensor`)."""
    head = f"{prefix}{WRAPPED}."
    items = list(state.items())
    for k, _ in items:
        if k.startswith(prefix):
            del state[k]
    for k, v in items:
        if isinstance(v, DTensor) and not isinstance(v, nn.Parameter) and v.data_ptr() != 0:
            v = savable_dtensor(v)
        state[prefix + k[len(head):] if k.startswith(head) else k] = v
    meta = getattr(state, "_metadata", None)
    if meta is not None:  # per-module versions, under the names the keys now have
        for k in [k for k in meta if k == head[:-1] or k.startswith(head)]:
            value = meta.pop(k)
            if k != head[:-1]:
                meta[prefix + k[len(head):]] = value


def wrapped_names(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing: list[str], unexpected: list[str], errors: list[str]) -> None:
    """load_state_dict pre-hook: the model's own names (what `own_names` wrote) are looked up
    under the wrapper's ``module.`` level, where nn.Module's loader finds the parameters."""
    for k in [k for k in state if k.startswith(prefix)]:
        state[f"{prefix}{WRAPPED}.{k[len(prefix):]}"] = state.pop(k)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        for k in [k for k in meta if k.startswith(prefix) and k != prefix.rstrip(".")]:
            meta[f"{prefix}{WRAPPED}.{k[len(prefix):]}"] = meta.pop(k)


def report_own_names(module: nn.Module, incompatible: Any) -> None:
    """load_state_dict post-hook: missing and unexpected keys under the names the user passed."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [k.replace(f"{WRAPPED}.", "", 1) if k.startswith(f"{WRAPPED}.") else k for k in keys]


def top_level_names(model: nn.Module) -> dict[str, str]:
    """``{name: "module"}`` for each first segment of the model's state-dict keys: the contract
    ``torch.distributed.checkpoint.state_dict`` reads from ``_fqn_modifiers`` (a key segment that
    stands for an attribute one level deeper)."""
    names = [*model._modules, *model._parameters, *model._buffers]
    return dict.fromkeys(names, WRAPPED)
