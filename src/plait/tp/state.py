"""The state of a tensor-parallel model (full state dicts, checkpoint entries): defined with the
placement record it reads, `plait.placement.state`, and importable here under its old name."""

from plait.placement.state import (  # noqa: F401 (the old path's names, re-exported)
    checkpoint_entry,
    full_state_dict,
    gather_full,
    load_full_state_dict,
    restore_entry,
)
