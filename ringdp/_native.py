"""The native extension ringdp._C, imported in one place, with a message that says how to
build it when it is missing."""
try:
    from . import _C
except ImportError as e:  # pragma: no cover - a broken install should say how to fix it
    raise ImportError(
        "ringdp's native extension ringdp._C is missing; build it with "
        "`pip install --no-build-isolation -e .` in the ringdp checkout"
    ) from e

RingError = _C.RingError

__all__ = ["_C", "RingError"]
