"""Expert parallelism: an MoE model's experts split over ep groups folded out of the data axes
(`expert_parallel`), tokens exchanged with all-to-alls of variable sizes (`ExpertDispatch`)."""

from plait.ep.apply import ExpertParallelInfo, ExpertPlacement, ep_info, expert_parallel, placement_of
from plait.ep.dispatch import ExpertDispatch

__all__ = ["expert_parallel", "ExpertDispatch", "ExpertPlacement", "ExpertParallelInfo", "ep_info",
           "placement_of"]
