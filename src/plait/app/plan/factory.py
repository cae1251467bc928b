"""`plait plan FACTORY`: any model a function builds, planned like plait's GPT.

The function (``package.module:function``, as `plait check` takes it) is called under
``torch.device("meta")`` and returns the model (or ``(model, ...)``, whose first item is used).
The rehearsal feeds it token ids of shape (sequences, ``--seq-len``) and trains it on the next
token, as `plait train` does; tensor-parallel plans come from `plait.plan_for` (plait's GPT and
the common transformers families), so a model it does not know is planned without ``--tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.app.config import TrainConfig
from plait.check.common import load_factory

DEFAULT_SEQ_LEN = 128


@dataclass
class FactoryTrainConfig(TrainConfig):
    """`TrainConfig` whose model is built by ``factory`` (on the meta device only: a plan's)."""

    factory: str = ""

    def make_model(self) -> nn.Module:
        fn = load_factory(self.factory)
        with torch.device("meta"):
            try:
                made = fn()
            except Exception as e:  # the user's code: bad input, said where
                raise ValueError(f"FACTORY {self.factory}: raised {type(e).__name__}: {e}") from None
        model = made[0] if isinstance(made, (tuple, list)) and made else made
        if not isinstance(model, nn.Module):
            raise ValueError(f"FACTORY {self.factory}: returned a {type(model).__name__}, not a "
                             "torch.nn.Module")
        return model

    @property
    def seq_len(self) -> int:
        return self.model.seq_len or DEFAULT_SEQ_LEN

    def _check_model_fit(self) -> None:
        """What holds for any model: the pipeline's cut and sequence parallelism's split; the rest
        (head counts against --tp, a plan for the model) is the layout's own to refuse."""
        par = self.parallel
        model = self.make_model()
        # The layout's rules without the tensor-parallel plan's layout trace: a plan search weighs many
        # layouts, and a factory's model may have no plan (its --tp layouts are refused when run).
        self._check_model_layout(model, f"FACTORY {self.factory}", trace_tp=False)
        if par.sequence_parallel and self.seq_len % (par.tp * par.cp):
            raise ValueError(f"--sequence-parallel splits the sequence over --tp {par.tp} x --cp {par.cp}: "
                             f"--seq-len {self.seq_len} must be divisible by {par.tp * par.cp}")
