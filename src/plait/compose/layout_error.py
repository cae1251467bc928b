"""`LayoutError`: a layout that cannot run, naming the fields it is about. Its own module so that
`plait.compose.parallel_plan` (which refuses a malformed plan) and `plait.compose.rules` (which refuses a plan
that does not fit a model and a mesh) raise the same error without importing each other."""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout that cannot run. ``fields`` names the mesh axes and `ParallelPlan` fields the
    refusal is about (a CLI maps them to its flags); ``nearest`` lists valid alternatives for
    ``axis`` as ``{axis: degree, data axis: degree}``, nearest first."""

    def __init__(self, message: str, fields: tuple[str, ...] = (), axis: str | None = None) -> None:
        super().__init__(message)
        self.message, self.fields, self.axis = message, fields, axis
        self.nearest: list[dict[str, int]] = []

    def __str__(self) -> str:
        if not self.nearest:
            return self.message
        shown = ", ".join(" ".join(f"{a}={d}" for a, d in n.items()) for n in self.nearest)
        return f"{self.message}; nearest valid: {shown}"


class LayoutTypeError(LayoutError, TypeError):
    """A `LayoutError` about a value of the wrong type (a loss that is not callable): a TypeError
    too, as Python says a wrong type, with the fields a CLI maps to its flags."""
