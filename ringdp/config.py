"""Every ``RINGDP_*`` setting, read in one place by one strict parser.

``Config.from_env()`` reads the environment once and returns a frozen :class:`Config`. A
communicator resolves one when it is created (``ringdp.init``) and a RingDDP when it is
constructed; nothing else in ringdp reads ``os.environ``. A malformed value is a
``ValueError`` that names the variable and says what it accepts; a ``RINGDP_*`` variable
that ringdp does not know is reported once with a warning (a typo must not be silently
ignored).

Defaults and their reasons live in ringdp/policy.py (measured thresholds, slot sizes).
"""
from __future__ import annotations

import dataclasses
import os
import string
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from . import policy

ALGOS = ("auto", "ring", "oneshot")
TRANSPORTS = ("auto", "ipc", "nccl")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Config:
    # -- every transport -----------------------------------------------------------------
    timeout_s: float = policy.DEFAULT_TIMEOUT_S  # RINGDP_TIMEOUT_S: seconds to wait for peers
    stall_warn_s: float = policy.DEFAULT_STALL_WARN_S  # RINGDP_STALL_WARN_S: stall report after (0: never)
    algo: str = "auto"  # RINGDP_ALGO: auto | ring | oneshot (a forced one-shot falls back above its buffer)
    # -- shared memory (CPU tensors) -----------------------------------------------------
    oneshot_max_bytes: int | None = None  # RINGDP_ONESHOT_MAX_BYTES (None: policy's per-world default)
    oneshot_bytes: int = policy.ONESHOT_BYTES  # RINGDP_ONESHOT_BYTES: the one-shot buffer
    slot_bytes: int = policy.SLOT_BYTES  # RINGDP_SLOT_BYTES
    fifo_slots: int = policy.FIFO_SLOTS  # RINGDP_FIFO_SLOTS
    arena_gb: float = policy.ARENA_GB  # RINGDP_ARENA_GB: virtual size of the registered arena
    spin_us: float | None = None  # RINGDP_SPIN_US (None: policy.spin_ns decides)
    inline_async_max_bytes: int = policy.INLINE_ASYNC_MAX_BYTES  # RINGDP_INLINE_ASYNC_MAX_BYTES: async
    # collectives this small run on the calling thread when nothing is queued (0, the default: never)
    # -- across hosts (CPU tensors) ------------------------------------------------------
    host_id: str = ""  # RINGDP_HOST_ID: this rank's host key ("": hostname + boot id); tests simulate hosts
    hierarchy: bool = True  # RINGDP_HIERARCHY: collectives across hosts hierarchical, CPU and CUDA (0: flat)
    hier_piece_bytes: int = policy.HIER_PIECE_BYTES  # RINGDP_HIER_PIECE_BYTES: minimum pipeline piece of the two-level path
    # -- CUDA ------------------------------------------------------------------------------
    transport: str = "auto"  # RINGDP_TRANSPORT: auto | ipc | nccl (auto: IPC on one host)
    cuda_slot_bytes: int = 0  # RINGDP_CUDA_SLOT_BYTES (0: the transport's default)
    cuda_slots: int = 0  # RINGDP_CUDA_SLOTS
    cuda_channels: int = 0  # RINGDP_CUDA_CHANNELS (0: SMs / ranks sharing the GPU)
    cuda_oneshot_bytes: int = 0  # RINGDP_CUDA_ONESHOT_BYTES: the IPC one-shot buffer (0: default)
    cuda_oneshot_max_bytes: int = 0  # RINGDP_CUDA_ONESHOT_MAX_BYTES (0: the whole buffer)
    cuda_registered: bool = True  # RINGDP_CUDA_REGISTERED: peers read registered tensors in place
    cuda_arena_mb: float = policy.CUDA_ARENA_MB  # RINGDP_CUDA_ARENA_MB
    nccl_library: str = ""  # RINGDP_NCCL_LIBRARY: path of libnccl.so.2
    nccl_hostid_per_rank: bool = False  # RINGDP_NCCL_HOSTID_PER_RANK: tests, several ranks per GPU
    # -- RingDDP ---------------------------------------------------------------------------
    ddp_in_grad_min_bytes: int = policy.IN_GRAD_MIN_BYTES  # RINGDP_DDP_IN_GRAD_MIN_BYTES (-1: never)
    ddp_overlap: bool = True  # RINGDP_DDP_OVERLAP
    trace: str | None = None  # RINGDP_TRACE: Chrome trace path of RingDDP's backward passes (trace_path;
    # unset or empty: off; any other value is a path, "0" too: the folder ./0); its folder also
    # receives each rank's flight record on a stall or a failed collective
    trace_steps: int = 1000  # RINGDP_TRACE_STEPS: steps with events and per-step rows (later: in the means only)
    # -- the torch.distributed backend -----------------------------------------------------
    backend_adopt_min_bytes: int = -1  # RINGDP_BACKEND_ADOPT_MIN_BYTES: all-reduced CPU tensors this
    # large, seen a second time, move into registered memory in place (-1: never; ringdp/backend.py)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Config":
        """Parse the RINGDP_* variables of `environ` (default: os.environ); a ValueError names
        the first invalid one. (Unknown RINGDP_* names are warned of once the rest is valid.)"""
        env = os.environ if environ is None else environ
        values, errors = _parse(env)
        if errors:
            raise ValueError(errors[0])
        _warn_unknown(env)
        return cls(**values)

    @classmethod
    def from_env_and_errors(cls, environ: Mapping[str, str] | None = None) -> tuple["Config", list[str]]:
        """The valid RINGDP_* settings of `environ` (default: os.environ), each invalid one left
        at its default, and the invalid ones' errors: for a report (python -m ringdp) that
        names every error and shows what the others select."""
        env = os.environ if environ is None else environ
        values, errors = _parse(env)
        _warn_unknown(env)
        return cls(**values), errors

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------- parsers
def _number(kind: type, minimum: float, strict: bool = False, what: str | None = None,
            maximum: float | None = None, multiple: int = 1, infinite: bool = False):
    """A parser of `kind` (int or float) values >= minimum (> minimum when strict), at most
    `maximum` (None: no bound; the bounds: policy.py "limits of the RINGDP_* values"), a
    multiple of `multiple`, and finite unless `infinite` (a timeout: _seconds)."""
    def parse(name: str, raw: str):
        try:
            v = kind(raw)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise ValueError(f"{name}={raw!r}: not {noun}") from None
        if v != v:  # NaN compares as nothing: every bound below would let it through
            raise ValueError(f"{name}={raw!r}: not a number")
        if v < minimum or (strict and v == minimum):
            bound = what or ("must be positive" if strict and minimum == 0 else f"must be >= {minimum:g}")
            raise ValueError(f"{name}={raw!r}: {bound}")
        most = "" if maximum is None else f"at most {maximum:g}" if isinstance(maximum, float) else f"at most {maximum}"
        if v == float("inf") and not infinite:
            raise ValueError(f"{name}={raw!r}: must be finite" + (most and f", {most}"))
        if maximum is not None and v > maximum:
            raise ValueError(f"{name}={raw!r}: must be {most}")
        if multiple > 1 and v % multiple:
            raise ValueError(f"{name}={raw!r}: must be a multiple of {multiple}")
        return v

    return parse


_nonneg_int = _number(int, 0)
_int_or_never = _number(int, -1, what="expected a byte count, or -1 for never")
_buffer_bytes = _number(int, 0, maximum=policy.MAX_BUFFER_BYTES)  # 0: the default (CUDA), or no one-shot (shm)
_slot_bytes = _number(int, policy.SLOT_MIN_BYTES, maximum=policy.MAX_BUFFER_BYTES, multiple=policy.SLOT_ALIGN_BYTES,
                      what=f"must be at least {policy.SLOT_MIN_BYTES}, a multiple of {policy.SLOT_ALIGN_BYTES}")
_slots = _number(int, 0, maximum=policy.MAX_SLOTS)  # 0: the transport's default


def _power_of_two(name: str, raw: str) -> int:
    """An int >= 2 that is a power of two (RINGDP_FIFO_SLOTS: a link's slot is its 32-bit
    slice counter modulo the slots, in order across the counter's wrap only then)."""
    v = _number(int, 2, maximum=policy.MAX_SLOTS)(name, raw)
    if v & (v - 1):
        raise ValueError(f"{name}={raw!r}: must be a power of two (2, 4, 8, ...)")
    return v


def _seconds(strict: bool) -> Callable[[str, str], float]:
    """Seconds (RINGDP_TIMEOUT_S: positive; RINGDP_STALL_WARN_S: 0 is never): above
    policy.MAX_TIMEOUT_S that bound, infinity included (policy.timeout_s, the one rule)."""
    number = _number(float, 0, strict=strict, infinite=True)

    def parse(name: str, raw: str) -> float:
        v = number(name, raw)
        return policy.timeout_s(v, None) if v > 0 else v

    return parse


def _bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/0 (or true/false, yes/no, on/off)")


def _choice(options: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        low = raw.lower()
        if low not in options:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(options)}")
        return low

    return parse


def _text(name: str, raw: str) -> str:
    return raw


def _check_trace_fields(what: str, raw: str) -> bool:
    """Whether the trace path `raw` has the field {rank}, its only possible field: a
    ValueError that starts with `what` (the variable or argument and its value) otherwise."""
    hint = "{rank} (the global rank) is the only field; write {{ and }} for literal braces"
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(raw) if f is not None]
    except ValueError as e:
        raise ValueError(f"{what}: a lone brace ({e}): {hint}") from None
    bad = next((f for f in fields if f != "rank"), None)
    if bad is not None:
        raise ValueError(f"{what}: unknown field {{{bad}}}: {hint}")
    try:
        raw.format(rank=0)
    except (ValueError, TypeError, KeyError, IndexError) as e:  # a format spec an int does not take
        # (or a nested field of the spec: {rank:{x}} is a KeyError, {rank:{0}} an IndexError)
        raise ValueError(f"{what}: {e}: {hint}") from None
    return bool(fields)


def _trace(name: str, raw: str) -> str:
    """RINGDP_TRACE: a path (a folder, a .json file, or a pattern with {rank}), checked when
    it is read so that a bad field fails there, naming the variable."""
    if "{" in raw or "}" in raw:
        _check_trace_fields(f"{name}={raw!r}", raw)
    return raw


_VARIABLES: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "RINGDP_TIMEOUT_S": ("timeout_s", _seconds(strict=True)),
    "RINGDP_STALL_WARN_S": ("stall_warn_s", _seconds(strict=False)),
    "RINGDP_ALGO": ("algo", _choice(ALGOS)),
    "RINGDP_ONESHOT_MAX_BYTES": ("oneshot_max_bytes", _nonneg_int),
    "RINGDP_ONESHOT_BYTES": ("oneshot_bytes", _buffer_bytes),
    "RINGDP_SLOT_BYTES": ("slot_bytes", _slot_bytes),
    "RINGDP_FIFO_SLOTS": ("fifo_slots", _power_of_two),
    "RINGDP_ARENA_GB": ("arena_gb", _number(float, 0, strict=True, maximum=policy.MAX_ARENA_GB)),
    "RINGDP_SPIN_US": ("spin_us", _number(float, 0, maximum=policy.MAX_SPIN_US)),
    "RINGDP_INLINE_ASYNC_MAX_BYTES": ("inline_async_max_bytes", _nonneg_int),
    "RINGDP_HOST_ID": ("host_id", _text),
    "RINGDP_HIERARCHY": ("hierarchy", _bool),
    "RINGDP_HIER_PIECE_BYTES": ("hier_piece_bytes", _number(int, 1)),
    "RINGDP_TRANSPORT": ("transport", _choice(TRANSPORTS)),
    "RINGDP_CUDA_SLOT_BYTES": ("cuda_slot_bytes", _buffer_bytes),
    "RINGDP_CUDA_SLOTS": ("cuda_slots", _slots),
    "RINGDP_CUDA_CHANNELS": ("cuda_channels", _slots),
    "RINGDP_CUDA_ONESHOT_BYTES": ("cuda_oneshot_bytes", _buffer_bytes),
    "RINGDP_CUDA_ONESHOT_MAX_BYTES": ("cuda_oneshot_max_bytes", _nonneg_int),
    "RINGDP_CUDA_REGISTERED": ("cuda_registered", _bool),
    "RINGDP_CUDA_ARENA_MB": ("cuda_arena_mb", _number(float, 0, maximum=policy.MAX_ARENA_GB << 10)),
    "RINGDP_NCCL_LIBRARY": ("nccl_library", _text),
    "RINGDP_NCCL_HOSTID_PER_RANK": ("nccl_hostid_per_rank", _bool),
    "RINGDP_DDP_IN_GRAD_MIN_BYTES": ("ddp_in_grad_min_bytes", _int_or_never),
    "RINGDP_DDP_OVERLAP": ("ddp_overlap", _bool),
    "RINGDP_TRACE": ("trace", _trace),
    "RINGDP_TRACE_STEPS": ("trace_steps", _nonneg_int),
    "RINGDP_BACKEND_ADOPT_MIN_BYTES": ("backend_adopt_min_bytes", _int_or_never),
}
# Read by setup.py / the build scripts, or by the tests themselves, not at run time.
_NOT_RUNTIME = {"RINGDP_BUILD_CUDA", "RINGDP_CUDA_ARCHS", "RINGDP_REQUIRE_CUDA"}
_warned: set[str] = set()


def unknown(env: Mapping[str, str]) -> list[str]:
    """The RINGDP_* names in `env` that ringdp does not read (build and test ones aside), sorted."""
    return sorted(name for name in env if name.startswith("RINGDP_") and name not in _VARIABLES
                  and name not in _NOT_RUNTIME and not name.startswith("RINGDP_TEST_"))


def _parse(env: Mapping[str, str]) -> tuple[dict, list[str]]:
    """The one parse of the RINGDP_* variables: {field: value} of the valid ones set, and the
    errors of the invalid ones (each parser's ValueError names the variable and the rule)."""
    values, errors = {}, []
    for name, (field, parse) in _VARIABLES.items():
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            values[field] = parse(name, raw.strip())
        except ValueError as e:
            errors.append(str(e))
    return values, errors


def _warn_unknown(env: Mapping[str, str]) -> None:
    for name in unknown(env):
        if name not in _warned:
            _warned.add(name)
            known = ", ".join(sorted(_VARIABLES))
            warnings.warn(f"ringdp: unknown environment variable {name} is ignored (known: {known})",
                          stacklevel=3)


def trace_path(path: str | os.PathLike, rank: int, group: str | None = None, kind: str = "trace") -> Path:
    """Where a process writes its file of `kind` for RINGDP_TRACE=`path` (or RingDDP(trace=path)):
    the one naming rule of these files. `kind` "trace": RingDDP's Chrome trace (ringdp/trace.py);
    "flight": a communicator's flight record (comm.py), in the trace's folder.

    `rank` is the process's global rank (torch.distributed.get_rank()), which no other process
    of the job has; `group` names the process group when it is not the world (comm.py's group
    key, e.g. "g3"; None for the world), so that one process's files for two groups differ too.

    Trace: a path with ``{rank}`` (the only field) is formatted, a ``.json`` path gets
    ``.rank<r>`` before the suffix, any other path is a folder (``ringdp_trace.rank<r>.json``
    in it); a group adds ``.<group>`` before the suffix. Flight record:
    ``ringdp_flight.rank<r>[.<group>].json`` in the trace file's folder. Any other field, or a
    lone brace, is a ValueError naming RINGDP_TRACE (``{{`` and ``}}`` are literal braces)."""
    s = os.fspath(path)
    if kind not in ("trace", "flight"):
        raise ValueError(f"trace_path: kind must be 'trace' or 'flight', got {kind!r}")
    tag = "" if group is None else f".{group}"
    pattern = False
    if "{" in s or "}" in s:
        pattern = _check_trace_fields(f"the trace path {s!r} (RINGDP_TRACE, or RingDDP(trace=))", s)
        s = s.format(rank=rank)  # (without the field: only literal braces, {{ and }})
    if pattern:
        p = Path(s)
    elif Path(s).suffix == ".json":
        p = Path(s).with_name(f"{Path(s).stem}.rank{rank}.json")
    else:
        p = Path(s) / f"ringdp_trace.rank{rank}.json"
    if kind == "flight":
        return p.parent / f"ringdp_flight.rank{rank}{tag}.json"
    return p.with_name(f"{p.stem}{tag}{p.suffix}") if tag else p


def variables() -> dict[str, str]:
    """Each variable and the Config field it sets (for docs and tests)."""
    return {name: field for name, (field, _) in _VARIABLES.items()}
