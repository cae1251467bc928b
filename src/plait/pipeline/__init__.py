"""Pipeline parallelism: stages split by module names, schedules as data, a P2P executor.

The package is callable: ``plait.pipeline(model, mesh, ...)`` is `plait.pipeline.pipeline`
(`plait.runtime.callable_module`), and ``plait.pipeline.zbv`` and ``plait.pipeline.split`` stay reachable.
"""

from plait.pipeline.actions import Action, Kind, Slot
from plait.pipeline.api import Pipeline, pipeline
from plait.pipeline.generators import (
    SCHEDULES,
    dualpipev,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_h1,
    zbv,
)
from plait.pipeline.schedules import Schedule, ScheduleError, with_comms
from plait.runtime.callable_module import make_callable

__all__ = ["pipeline", "Pipeline", "Schedule", "ScheduleError", "Action", "Kind", "Slot", "SCHEDULES",
           "make_schedule", "with_comms", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zbv",
           "dualpipev"]

make_callable(__name__)
