"""Modules that are also their namesake function: ``plait.pipeline(...)`` beside ``plait.pipeline.zbv``.

`plait.pipeline`, `plait.check` and `plait.parallelize` each name both a function and the module
(or package) that holds it. A package attribute is one object: bound to the function, it hides
the module, and after ``import plait`` the names under it (``plait.pipeline.zbv``,
``plait.parallelize.ORDER``) are looked up on the function and fail. So the attribute stays the
module, and the module is made callable: ``plait.pipeline(...)`` calls
``plait.pipeline.pipeline(...)``. Assigning a `types.ModuleType` subclass to a module's
``__class__`` is Python's documented hook for module behaviour (the data model's "Customizing
module attribute access"); the module keeps its identity, its ``sys.modules`` entry and every
attribute, so ``import plait.pipeline.split`` and ``from plait.pipeline import zbv`` are unchanged.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from plait._torch_compat import set_class


class CallableModule(types.ModuleType):
    """A module whose call is a call of its namesake function (``plait.check`` -> ``plait.check.check``)."""

    @property
    def function(self) -> Any:
        """The function the module's call runs: its attribute named like the module's last segment."""
        return getattr(self, self.__name__.rpartition(".")[2])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # so help() and inspect show the function's arguments
        return inspect.signature(self.function)


def make_callable(name: str) -> None:
    """Make the module ``name`` (already in ``sys.modules``, normally the caller's ``__name__``) a
    `CallableModule`; it must define its namesake function."""
    module = sys.modules[name]
    if not callable(getattr(module, name.rpartition(".")[2], None)):
        raise TypeError(f"module {name} has no function {name.rpartition('.')[2]} to call")
    set_class(module, CallableModule)
