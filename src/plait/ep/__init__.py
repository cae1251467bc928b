"""Expert parallelism: an MoE model's experts split over ep groups folded out of the data axes
(`expert_parallel`), tokens exchanged with all-to-alls of variable sizes (`ExpertDispatch`)."""

from plait.ep.apply import expert_parallel
from plait.ep.dispatch import ExpertDispatch
from plait.placement.records import ExpertParallelInfo, ExpertPlacement, ep_info, placement_of

__all__ = ["expert_parallel", "ExpertDispatch", "ExpertPlacement", "ExpertParallelInfo", "ep_info",
           "placement_of"]
