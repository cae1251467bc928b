"""`plait train`'s configuration: typed sections, read from flags and from a TOML file.

The sections are dataclasses (model, parallel, optimizer, data, checkpoint, run); `tyro`
turns their fields, types and docstrings into the command line, with each flag named after
its field alone (``--tp``, ``--zero-stage``, ``--lr``), so the flat flags scripts already use
keep working. ``--config run.toml`` reads the same fields grouped by section::

    [parallel]
    strategy = "fsdp"
    nproc = 4
    tp = 2

    [optimizer]
    lr = 1e-3

Flags on the command line override the file. Every combination that could not run is refused
by `TrainConfig` itself, in the parent process, before any rank is spawned.
"""

# The names the rest of the library reads from the package (an internal one: no __all__).
from plait.app.config.arguments import ConfigFileError, given_flags, parse_args, to_toml  # noqa: F401
from plait.app.config.refusals import in_flags  # noqa: F401
from plait.app.config.sections import (  # noqa: F401 (the choices' types too, as the one module exported them)
    FIELD_FLAGS,
    FLAGS,
    MIXED_PRECISIONS,
    SECTIONS,
    STRATEGIES,
    BalanceStatistic,
    Checkpointing,
    CheckpointSection,
    CPAlgorithm,
    DataSection,
    ModelName,
    ModelSection,
    OptimizerSection,
    ParallelSection,
    Precision,
    RunSection,
    ScheduleName,
    Strategy,
    TokenDtype,
    ZeroStage,
)
from plait.app.config.train_config import TrainConfig  # noqa: F401
