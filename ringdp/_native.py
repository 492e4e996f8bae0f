"""The native extension ringdp._C, imported in one place, with a message that says how to
build it when it is missing or does not load."""
try:
    from . import _C
except ImportError as e:
    import importlib.util

    if importlib.util.find_spec(f"{__package__}._C") is None:  # no extension next to the package
        raise ImportError(
            "ringdp's native extension ringdp._C is missing; build it with "
            "`pip install --no-build-isolation -e .` in the ringdp checkout"
        ) from e
    import torch  # there, but it does not load: most often built against another torch

    raise ImportError(
        f"ringdp's native extension ringdp._C does not load ({e}). It must be built against the "
        f"torch that runs it (torch {torch.__version__} here): rebuild it with "
        "`pip install --no-build-isolation -e .` in the ringdp checkout (or a wheel built with that torch)"
    ) from e

RingError = _C.RingError

__all__ = ["_C", "RingError"]
