"""State of a wrapper that keeps the whole module (DataParallel's threads, DDP's replicas)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class WrappedModuleState:
    """Full state dicts and checkpoints of such a wrapper are its ``module``'s, under the module's
    own names (no ``module.`` prefix): `plait.full_state_dict` and the checkpoint protocol
    (`plait.state.checkpoint.protocol`) are asked of the wrapped module."""

    module: nn.Module

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from plait.state.state_dict import full_state_dict

        return full_state_dict(self.module)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        from plait.state.state_dict import load_full_state_dict

        load_full_state_dict(self.module, state)

    def checkpoint_state(self, optimizer: Any) -> dict[str, Any]:
        from plait.state.checkpoint.protocol import state_dict

        return state_dict(self.module, optimizer)

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: Any) -> None:
        from plait.state.checkpoint.protocol import load_state_dict

        load_state_dict(self.module, optimizer, state)
