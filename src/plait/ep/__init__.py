"""Expert parallelism: an MoE model's experts split over ep groups folded out of the data axes
(`expert_parallel`), tokens exchanged with all-to-alls of variable sizes (`ExpertDispatch`)."""

# An internal package (no __all__): `plait.expert_parallel`'s home, and the names beside it.
from plait.ep.apply import expert_parallel  # noqa: F401
from plait.ep.dispatch import ExpertDispatch  # noqa: F401
