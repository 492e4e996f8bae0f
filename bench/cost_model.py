"""Alpha-beta cost model of ringdp's two-level all-reduce across hosts (issue 12, point 7;
docs/hierarchy.md explains it).

Run it
    python bench/cost_model.py --out-dir bench/results

It does three things, reading only committed benchmark JSONs (bench/allreduce.py's format):
  fit        time = alpha + beta * S by least squares (weighted by 1/time, so every size
             counts by its relative error) for each component measured on the 2-core box:
             gloo all-reduce on 2 ranks, ringdp's shm reduce-scatter and all-gather on 2
             ranks, flat gloo all-reduce on 4 ranks (the --hosts 2 run)
  validate   predict the --hosts 2 run (2 simulated hosts x 2 ranks) from the components and
             print predicted against measured. On that box nothing overlaps: gloo over
             loopback TCP and the shm copies are all CPU work of 4 processes on 2 cores, so
             the two-level time is a sequential sum (both hosts working at once). The
             components were measured with 2 ranks alone on the box, the --hosts 2 run has
             4: a contention factor scales them (nominal: 2 = 4 processes / 2 cores;
             calibrated: shm copies by the ratio of the memcpy bandwidth per rank with all
             ranks copying at once in the two files, gloo by flat gloo's 4-rank beta over
             1.5 x its 2-rank beta; from its steps, where the run timed them alone with
             --series parts: their times over the fits, steps_factors). The pieces are
             those the run was measured with:
             the file's "hier_pieces" (at most max_pieces of at least min_piece_bytes,
             policy.two_level_piece_bytes), or fixed 16 MiB pieces for files written before
             it (ringdp's rule until then)
  link       the projection's own formulas (flat_ring, two_level with ringdp's pieces, the
             one-NIC-per-host case) with this box's parameters (G = 2 ranks per host; in-host
             bandwidth and latency from the shm fits with the calibrated contention; network
             latency from gloo's; the NIC = the link's rate) against a run across two hosts
             in Linux namespaces whose veth link is shaped (bench/netns_hosts.py --rate): a
             network slower than the hosts, as between real ones, where the network term
             and the overlap of in-host steps with it are what the projection rests on
  project    flat ring over H x G GPUs against the two-level algorithm (in-host RS/AG at
             NCCL's in-host ring busbw, inter-host all-reduce of 1/G of the data among H
             ranks per local rank), H = 2..16 hosts of G = 8 GPUs, 400 Gb/s NICs (one per GPU,
             or one per host), 1 MiB..1 GiB; pipelined in pieces as ringdp's _two_level
             schedules them (rs 0, rs 1, ag 0, rs 2, ag 1, ...; the inter-host all-reduce of
             piece i runs while piece i+1 is reduce-scattered): ringdp's default pieces
             (ringdp/policy.py two_level_piece_bytes, imported: at most HIER_MAX_PIECES pieces
             of at least RINGDP_HIER_PIECE_BYTES), fixed 16 MiB pieces (ringdp's rule before
             it), the best piece of a grid, and unpipelined; then with ringdp's call check
             (a gloo all-to-all of a row across the H hosts per call: one step of an assumed
             latency and H-1 small messages, beside the first in-host step) for a range of
             that latency, and as the ring all-gather (H-1 steps) it was before

Writes <out-dir>/cost_model_projection.json (fits, validation, assumptions, grid) and
<out-dir>/cost_model_projection.png (speedup of two-level over the flat ring against size,
one line per H, one panel per NIC case). numpy and matplotlib only; no torch (ringdp/policy.py
is loaded from its file, not through the ringdp package, which imports torch).

Model (per step alpha, per byte beta; S = bytes of the tensor; n ranks):
    ring all-reduce      2(n-1) alpha + 2(n-1)/n S beta
    ring reduce-scatter   (n-1) alpha +  (n-1)/n S beta   (S = the input, the larger buffer)
    ring all-gather       (n-1) alpha +  (n-1)/n S beta   (S = the output)
    n = 1: 0.
    call check            alpha_check + (H-1) msg (gloo all-to-all; before: (H-1) alpha_check,
                          its ring all-gather), beside the first in-host reduce-scatter
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _common import count, counts, positive  # noqa: E402


def _load_policy():
    """ringdp/policy.py by its path: the rule ringdp runs, without importing torch."""
    spec = importlib.util.spec_from_file_location("_ringdp_policy", ROOT / "ringdp" / "policy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


policy = _load_policy()
MiB = 1 << 20
GB = 1e9

# ----------------------------------------------------------------------------- projection defaults
# Each with its source; docs/hierarchy.md lists them as assumptions.
DEFAULTS = {
    "gpus_per_host": 8,
    "hosts": [2, 4, 8, 16],
    "sizes": [MiB << k for k in range(11)],  # 1 MiB .. 1 GiB
    # NCCL ring all-reduce busbw inside one host of 8 H100 (NVLink 4): 365-370 GB/s
    # (nccl-tests issues 212, 272; /work/shared/REFERENCE.md). Used for RS and AG as well.
    "nvlink_busbw_GBps": 370.0,
    # 400 Gb/s NDR: "46-48 GB/s per NIC" (NVIDIA, nccl-tests issue 290)
    "nic_GBps": 46.0,
    # NCCL's own tuning model (src/graph/tuning.cc, Simple protocol, ring): per step
    # 3.4 us on NVLink, 9.6 us on the network, 8.4 us base latency per collective
    "alpha_nvlink_us": 3.4,
    "alpha_net_us": 9.6,
    "launch_us": 8.4,
    # the call check (ringdp/hosts.py CrossHost._check): a few-word row per member gathered
    # per call in the cross-host group of H ranks over the hosts' TCP network (call_check,
    # CHECK_SHAPES), on the issuing thread while the first in-host reduce-scatter runs on the
    # GPU. Assumed 50 us a step (a kernel TCP message and gloo's handling of it); 20 and 200 us
    # bound it in the sensitivity table (gloo issue 158: a 1 KB all-reduce of 2 hosts over
    # TCP, 2 steps, took 354 us, ~177 us a step, in 2018)
    "alpha_check_us": 50.0,
    "alpha_check_range_us": [20.0, 50.0, 200.0],
    # ringdp sends the rows as gloo's all-to-all (every message posted at once: one step); each
    # of its H-1 messages still costs the sender and receiver a little: assumed 5 us
    "check_msg_us": 5.0,
    "min_piece_bytes": policy.HIER_PIECE_BYTES,  # RINGDP_HIER_PIECE_BYTES default: the minimum piece
    "max_pieces": policy.HIER_MAX_PIECES,
    "fixed_piece_bytes": 16 * MiB,  # the rule before policy.two_level_piece_bytes: fixed 16 MiB pieces
}
NIC_CASES = {"nic_per_gpu": "one 400 Gb/s NIC per GPU (DGX H100: 8 per host)",
             "nic_per_host": "one 400 Gb/s NIC per host"}


# ----------------------------------------------------------------------------- ring formulas
def ring_allreduce(n: int, S: float, alpha: float, beta: float) -> float:
    """Ring all-reduce of S bytes on n ranks: 2(n-1) steps of S/n each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * S * beta


def ring_reduce_scatter(n: int, S: float, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of an S-byte input on n ranks (also the all-gather of an S-byte output)."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * S * beta


ring_all_gather = ring_reduce_scatter


# ----------------------------------------------------------------------------- fitting
def fit_alpha_beta(x, t, relative: bool = True, alpha: float | None = None) -> dict:
    """Least squares fit of t = alpha + beta * x. relative: minimise the relative errors
    (each row weighted by 1/t), else the absolute ones. alpha given: only beta is fitted.
    Returns alpha, beta, the rms and max relative error of the fit over its rows, and the
    row count."""
    x = np.asarray(x, float)
    t = np.asarray(t, float)
    if len(x) < (1 if alpha is not None else 2) or (alpha is None and len(set(x.tolist())) < 2):
        raise ValueError("fit_alpha_beta needs at least two different sizes (one with alpha given)")
    w = 1.0 / t if relative else np.ones_like(t)
    if alpha is None:
        A = np.stack([np.ones_like(x), x], 1) * w[:, None]
        (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    else:
        xw, rw = x * w, (t - alpha) * w
        beta = float(np.dot(xw, rw) / np.dot(xw, xw))
    err = (alpha + beta * x - t) / t
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta),
            "GBps": float(1 / beta / GB) if beta > 0 else None,
            "rms_rel_err": float(np.sqrt(np.mean(err ** 2))), "max_rel_err": float(np.max(np.abs(err))),
            "rows": int(len(x)), "min_bytes": int(x.min()), "max_bytes": int(x.max())}


def predict(fit: dict, S) -> float:
    return fit["alpha_s"] + fit["beta_s_per_byte"] * S


# ----------------------------------------------------------------------------- the 2-core box
# component -> (file, series, smallest size fitted, what it is)
COMPONENTS = {
    "gloo2": ("allreduce_cpu_w2_float32.json", "gloo", MiB,
              "gloo all-reduce, 2 ranks alone on the box (S = tensor bytes)"),
    "shm_rs": ("reduce_scatter_cpu_w2_float32.json", "ringdp", 16 * MiB,
               "ringdp shm reduce-scatter, 2 ranks alone (S = input bytes)"),
    "shm_ag": ("all_gather_cpu_w2_float32.json", "ringdp", 16 * MiB,
               "ringdp shm all-gather, 2 ranks alone (S = output bytes)"),
    "gloo4_flat": ("allreduce_cpu_w4_float32_hosts2.json", "gloo", MiB,
                   "flat gloo all-reduce, 4 ranks on 2 cores (the --hosts 2 run)"),
}
FIT_RANGE_WHY = ("gloo rows from 1 MiB (below, gloo's times are noisy: mean 3x the median at 4 KiB); "
                 "shm rows from 16 MiB, one pipeline piece (below, the copies run from cache and are up "
                 "to 2x faster per byte than from DRAM, which a straight line cannot follow); where the "
                 "line through those rows has alpha < 0 (both shm components), alpha is the time measured "
                 "at the smallest size (4 KiB) and beta alone is fitted")


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def series_rows(doc: dict, series: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(r["size"], r["time_us"] * 1e-6) for r in doc["rows"] if r.get("series") == series]
    if not rows:
        raise ValueError(f"no rows of series {series!r}")
    a = np.array(sorted(rows), float)
    return a[:, 0], a[:, 1]


def fit_series(doc: dict, fname: str, name: str) -> dict:
    """COMPONENTS[name]'s fit on the run `doc` (read from `fname`)."""
    _, series, min_bytes, what = COMPONENTS[name]
    x, t = series_rows(doc, series)
    keep = x >= min_bytes
    f = fit_alpha_beta(x[keep], t[keep])
    if f["alpha_s"] < 0:  # the line through the DRAM regime crosses below 0: take the
        # latency from the smallest size measured and fit beta alone
        f = dict(fit_alpha_beta(x[keep], t[keep], alpha=float(t[0])), alpha_from=f"time at {int(x[0])} B")
    allx = (f["alpha_s"] + f["beta_s_per_byte"] * x - t) / t
    f.update(file=fname, series=series, what=what, rms_rel_err_all_sizes=float(np.sqrt(np.mean(allx ** 2))))
    return f


def fit_components(results: Path) -> tuple[dict, dict]:
    fits, docs = {}, {}
    for name, (fname, *_) in COMPONENTS.items():
        fits[name] = fit_series(docs.setdefault(fname, load(results / fname)), fname, name)
    return fits, docs


def contention_factors(fits: dict, docs: dict, run: dict | None = None) -> dict:
    """Nominal and calibrated factors by which the 2-rank components slow down in the
    4-process --hosts 2 run (`run`; None: the one in COMPONENTS, fits["gloo4_flat"] its fit)."""
    def per_rank(d):
        return d["memcpy"]["all_ranks_at_once_GBps_per_rank"]

    hosts2 = per_rank(run if run is not None else docs[COMPONENTS["gloo4_flat"][0]])
    shm_file = COMPONENTS["shm_rs"][0]
    shm = per_rank(docs[shm_file])
    return {
        "nominal": {"shm": 2.0, "gloo": 2.0,
                    "why": "4 processes share 2 cores, each gets half a core (assumed)"},
        "calibrated": {
            "shm": shm / hosts2,
            "gloo": fits["gloo4_flat"]["beta_s_per_byte"] / (1.5 * fits["gloo2"]["beta_s_per_byte"]),
            "why": (f"shm: memcpy GB/s per rank with all ranks copying at once, {shm:.1f} in "
                    f"{shm_file} (2 ranks) / {hosts2:.1f} in the --hosts 2 run (4 ranks); gloo: flat gloo's "
                    "4-rank beta / (1.5 x its 2-rank beta): a 4-rank ring moves 1.5 S per rank, a 2-rank one S"),
        },
    }


# the contention factors a prediction may use: nominal and calibrated always, "steps" where the
# run timed its steps alone (steps_factors)
FACTOR_KINDS = ("nominal", "calibrated", "steps")


def steps_factors(run: dict, fits: dict) -> dict | None:
    """The contention factors read off a --hosts 2 run's own steps timed alone
    (bench/allreduce.py --series parts), None for a run without them: the median, over its
    sizes from 16 MiB, of part:inhost's time over the 2-rank shm reduce-scatter + all-gather
    fits at S, and of part:cross's time over the 2-rank gloo fit at S/2 (both pairs at once,
    as in the call). With them the two-level prediction tests only the model's structure:
    the call is the sum of its steps, piece by piece."""
    m = measured_times(run)
    big = sorted(S for S in m if S >= 16 * MiB and {"part:inhost", "part:cross"} <= set(m[S]))
    if not big:
        return None
    shm = float(np.median([m[S]["part:inhost"] / (predict(fits["shm_rs"], S) + predict(fits["shm_ag"], S))
                           for S in big]))
    gloo = float(np.median([m[S]["part:cross"] / predict(fits["gloo2"], S / 2) for S in big]))
    return {"shm": shm, "gloo": gloo,
            "why": (f"the run's part:inhost and part:cross times over the 2-rank fits, median over "
                    f"{len(big)} sizes from 16 MiB")}


def box_two_level(S: float, fits: dict, c_shm: float, c_gloo: float, piece_bytes: int, local: int = 2) -> dict:
    """Two-level all-reduce on the box, 2 hosts x `local` ranks, nothing overlapping: per
    piece of p bytes the shm reduce-scatter and all-gather of p on `local` ranks and the gloo
    all-reduce of p/local on 2 ranks (both pairs at once), each scaled by its contention
    factor; summed over the pieces (each pays its alphas); plus the call check, once per call:
    one more gloo round trip in the same 2-member groups (an all-gather of a row of a few
    words, so gloo2's alpha, under gloo's contention), which overlaps nothing here either.
    (Since the overlapped check, a one-piece call with a block over policy.FOLD_MAX_BLOCK_BYTES
    sends a second, header-only one beside its gloo step: not in the model.)"""
    assert local == 2, "the components were measured on 2 ranks"
    pieces = _pieces(S, piece_bytes)
    shm = sum(predict(fits["shm_rs"], p) + predict(fits["shm_ag"], p) for p in pieces)
    gloo = sum(predict(fits["gloo2"], p / local) for p in pieces)
    check = c_gloo * fits["gloo2"]["alpha_s"]
    return {"total_s": c_shm * shm + c_gloo * gloo + check, "shm_s": c_shm * shm, "gloo_s": c_gloo * gloo,
            "check_s": check, "pieces": len(pieces)}


def box_flat_gloo(S: float, fits: dict, c_gloo: float, n: int = 4) -> float:
    """Flat gloo ring over n ranks from the 2-rank fit: 2(n-1) steps of alpha_2/2 each and
    2(n-1)/n S bytes per rank (the 2-rank ring moves S), times the contention factor."""
    g = fits["gloo2"]
    return c_gloo * ring_allreduce(n, S, g["alpha_s"] / 2, g["beta_s_per_byte"])


def measured_pieces(doc: dict):
    """The piece rule a --hosts run was measured with: bytes -> piece bytes. The file's
    "hier_pieces" (policy.two_level_piece_bytes with its minimum and count), else fixed 16 MiB
    pieces (files written before that rule; RINGDP_HIER_PIECE_BYTES if it was set)."""
    hp = doc.get("hier_pieces")
    if hp:
        return lambda S: policy.two_level_piece_bytes(int(S), hp["min_piece_bytes"], hp["max_pieces"])
    fixed = int(doc.get("env", {}).get("RINGDP_HIER_PIECE_BYTES", DEFAULTS["fixed_piece_bytes"]))
    return lambda S: fixed


def measured_times(doc: dict) -> dict:
    """A run's times in seconds: size -> series -> time per call."""
    measured: dict = {}
    for r in doc["rows"]:
        measured.setdefault(r["size"], {})[r["series"]] = r["time_us"] * 1e-6
    return measured


def validate(doc: dict, fits: dict, factors: dict) -> list[dict]:
    """Predicted against measured for every size from 1 MiB of the --hosts 2 run `doc`."""
    piece_of = measured_pieces(doc)
    measured = measured_times(doc)
    kinds = [k for k in FACTOR_KINDS if k in factors]
    out = []
    for S in sorted(measured):
        if S < MiB:
            continue
        row = {"size": int(S), "piece_bytes": int(min(S, piece_of(S)))}
        for kind in kinds:
            c = factors[kind]
            tl = box_two_level(S, fits, c["shm"], c["gloo"], piece_of(S))
            row[f"two_level_pred_{kind}_s"] = tl["total_s"]
            row[f"two_level_gloo_part_{kind}_s"] = tl["gloo_s"]
            row[f"two_level_shm_part_{kind}_s"] = tl["shm_s"]
            row[f"flat_gloo_pred_{kind}_s"] = box_flat_gloo(S, fits, c["gloo"])
        for series, key in (("ringdp", "two_level"), ("gloo", "flat_gloo"), ("ringdp-flat", "ringdp_flat")):
            if series in measured[S]:
                row[f"{key}_measured_s"] = measured[S][series]
        for kind in kinds:
            if "two_level_measured_s" in row:
                row[f"two_level_err_{kind}"] = row[f"two_level_pred_{kind}_s"] / row["two_level_measured_s"] - 1
            if "flat_gloo_measured_s" in row:
                row[f"flat_gloo_err_{kind}"] = row[f"flat_gloo_pred_{kind}_s"] / row["flat_gloo_measured_s"] - 1
        out.append(row)
    return out


def validation_summary(val: list[dict]) -> dict:
    """The largest relative error from 16 MiB to 256 MiB of each prediction."""
    big = [r for r in val if 16 * MiB <= r["size"] <= 256 * MiB]
    return {f"{what}_{k}_max_abs_err": max(abs(r[f"{what}_err_{k}"]) for r in big)
            for what in ("two_level", "flat_gloo") for k in FACTOR_KINDS if f"{what}_err_{k}" in big[0]}


# every --hosts 2 all-reduce run committed (the one in COMPONENTS, later sweeps, repeats)
HOSTS2_RUNS = "allreduce_cpu_w4_float32*_hosts2.json"


def validate_runs(results: Path, fits: dict, docs: dict) -> list[dict]:
    """The same 2-rank component fits against each --hosts 2 run committed: a run's own flat
    gloo fit and memcpy probe give its calibrated factors; the errors show how far one
    run's agreement carries to the next on this VM. A run that reaches none of the sizes
    the validation covers (16-256 MiB: validation_summary; a sweep of small sizes alone) is
    left out."""
    out = []
    for path in sorted(results.glob(HOSTS2_RUNS)):
        run = load(path)
        hosts = run.get("hosts") or []
        if sorted(hosts.count(h) for h in set(hosts)) != [2, 2] or run.get("collective") != "all_reduce":
            continue  # the model is of 2 hosts x 2 ranks
        if not any(16 * MiB <= S <= 256 * MiB for S in measured_times(run)):
            continue  # nothing to validate
        run_fits = dict(fits, gloo4_flat=fit_series(run, path.name, "gloo4_flat"))
        factors = contention_factors(run_fits, docs, run)
        steps = steps_factors(run, fits)
        if steps is not None:
            factors["steps"] = steps
        out.append({"file": path.name, "fitted": path.name == COMPONENTS["gloo4_flat"][0],
                    "contention_calibrated": {k: factors["calibrated"][k] for k in ("shm", "gloo")},
                    "contention_steps": None if steps is None else {k: steps[k] for k in ("shm", "gloo")},
                    "memcpy_GBps_per_rank": run["memcpy"]["all_ranks_at_once_GBps_per_rank"],
                    **validation_summary(validate(run, run_fits, factors))})
    return out


# ----------------------------------------------------------------------------- a shaped link
# the run across two namespace hosts on a shaped link (README "Across hosts" gives its command)
LINK_FILE = "allreduce_cpu_w4_float32_netns_2gbit.json"
_TC_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def link_rate_Bps(doc: dict) -> float:
    """The shaped link's rate in bytes/s, from the run's machine.network (bench/netns_hosts.py:
    "..., 2gbit each way (tc tbf)"; tc's units: kbit = 1000 bits/s)."""
    m = re.search(r"(\d+(?:\.\d+)?)([kmg]?)bit each way", doc.get("machine", {}).get("network", ""))
    if not m:
        raise ValueError(f"no shaped link in machine.network: {doc.get('machine', {}).get('network')!r}")
    return float(m.group(1)) * _TC_UNITS[m.group(2)] / 8


def box_hw(fits: dict, factors: dict, rate_Bps: float) -> dict:
    """hw_params' machine for the box as 2 hosts x 2 ranks on one link (nic_per_host, G = 2):
    in-host ring RS/AG of p bytes = a_nv + p/2 / b_nv, matched to the shm fits (the mean of
    RS and AG) times the calibrated shm contention; a_net per network step = gloo2's alpha
    / 2 (its 2 steps), a_check the same (the call check is gloo too); the NIC = the link."""
    c = factors["calibrated"]["shm"]
    alpha = (fits["shm_rs"]["alpha_s"] + fits["shm_ag"]["alpha_s"]) / 2
    beta = (fits["shm_rs"]["beta_s_per_byte"] + fits["shm_ag"]["beta_s_per_byte"]) / 2
    return {"G": 2, "nics": 1, "b_nv": 1 / (2 * c * beta), "b_nic": rate_Bps, "a_nv": c * alpha,
            "a_net": fits["gloo2"]["alpha_s"] / 2, "a_check": fits["gloo2"]["alpha_s"] / 2, "launch": 0.0}


def validate_link(doc: dict, fits: dict, factors: dict) -> dict:
    """Predicted (flat_ring; two_level with the pieces the run used and the call check)
    against measured (gloo; ringdp two-level) for every size from 1 MiB of the shaped-link run."""
    rate = link_rate_Bps(doc)
    hw = box_hw(fits, factors, rate)
    piece_of = measured_pieces(doc)
    measured = measured_times(doc)
    rows = []
    for S in sorted(measured):
        m = measured[S]
        if S < MiB or "gloo" not in m or "ringdp" not in m:
            continue
        flat, two = flat_ring(S, 2, hw), two_level(S, 2, hw, piece_of(S), check=True)
        rows.append({"size": int(S), "pieces": len(_pieces(S, piece_of(S))),
                     "flat_pred_s": flat, "flat_measured_s": m["gloo"], "flat_err": flat / m["gloo"] - 1,
                     "two_level_pred_s": two, "two_level_measured_s": m["ringdp"],
                     "two_level_err": two / m["ringdp"] - 1,
                     "speedup_pred": flat / two, "speedup_measured": m["gloo"] / m["ringdp"],
                     "two_level_reg_measured_s": m.get("ringdp-reg")})
    big = [r for r in rows if r["size"] >= 16 * MiB]
    return {"file": LINK_FILE, "network": doc["machine"]["network"], "rate_Bps": rate,
            "hw": {k: v for k, v in hw.items()}, "rows": rows,
            "max_abs_err_from_16MiB": max(max(abs(r["flat_err"]), abs(r["two_level_err"])) for r in big),
            "bytes_bound_speedup": (1 - 1 / 4) / (1 - 1 / 2)}


# ----------------------------------------------------------------------------- projection
def _pieces(S: float, piece_bytes: float | None) -> list[float]:
    if not piece_bytes or piece_bytes >= S:
        return [float(S)]
    n, rest = divmod(S, piece_bytes)
    return [float(piece_bytes)] * int(n) + ([float(rest)] if rest else [])


def hw_params(nic_case: str, G: int = 8, **over) -> dict:
    """Machine parameters in seconds and bytes/s. nic_case: nic_per_gpu (G NICs per host)
    or nic_per_host (one)."""
    p = {k: DEFAULTS[k] for k in ("nvlink_busbw_GBps", "nic_GBps", "alpha_nvlink_us", "alpha_net_us", "launch_us",
                                  "alpha_check_us", "check_msg_us")}
    p.update({k: v for k, v in over.items() if v is not None})
    return {"G": G, "nics": G if nic_case == "nic_per_gpu" else 1, "b_nv": p["nvlink_busbw_GBps"] * GB,
            "b_nic": p["nic_GBps"] * GB, "a_nv": p["alpha_nvlink_us"] * 1e-6, "a_net": p["alpha_net_us"] * 1e-6,
            "launch": p["launch_us"] * 1e-6, "a_check": p["alpha_check_us"] * 1e-6,
            "o_check": p["check_msg_us"] * 1e-6}


CHECK_SHAPES = {"alltoall": "gloo's all-to-all of the row to every member, the H-1 messages posted at once: "
                            "one step and H-1 message costs (what ringdp runs)",
                "ring": "gloo's ring all-gather: H-1 steps (what ringdp ran until 2026-12-05)"}


def call_check(H: int, hw: dict) -> float:
    """The call check of one two-level call, a row per host among the H ranks of a cross-host
    group (its few words add nothing), in hw["check_shape"] (CHECK_SHAPES; default alltoall,
    ringdp's): one step of a_check and H-1 messages of o_check, or a ring of H-1 steps."""
    if H <= 1:
        return 0.0
    if hw.get("check_shape", "alltoall") == "ring":
        return (H - 1) * hw["a_check"]
    return hw["a_check"] + (H - 1) * hw.get("o_check", 0.0)


def flat_ring(S: float, H: int, hw: dict) -> float:
    """NCCL-style flat ring over N = H x G GPUs, laid out host by host, its channels spread
    over the host's NICs. Latency as NCCL's tuning model: 2(N-1) steps of which 2(H-1) cross
    the network. Bandwidth: every GPU sends 2(N-1)/N S; on one host a ring stays on NVLink
    (b_nv per GPU); across hosts (G-1)/G of it goes on NVLink and each host sends
    2(N-1)/N S out over its `nics` NICs; the slower of the two sets the time."""
    G = hw["G"]
    N = H * G
    if N <= 1:
        return 0.0
    lat = hw["launch"] + 2 * (N - H) * hw["a_nv"] + 2 * (H - 1) * hw["a_net"]
    vol = 2 * (N - 1) / N * S
    if H == 1:
        return lat + vol / hw["b_nv"]
    return lat + vol * max((G - 1) / G / hw["b_nv"], 1 / (hw["nics"] * hw["b_nic"]))


def _stages(p: float, H: int, hw: dict) -> tuple[float, float, float]:
    """Times of one piece of p bytes: in-host reduce-scatter, inter-host all-reduce of the
    local rank's p/G block among H ranks (G/nics local ranks share a NIC), in-host all-gather."""
    G = hw["G"]
    rs = (hw["launch"] + ring_reduce_scatter(G, p, hw["a_nv"], 1 / hw["b_nv"])) if G > 1 else 0.0
    per_rank_nic = hw["nics"] * hw["b_nic"] / G
    ar = (hw["launch"] + ring_allreduce(H, p / G, hw["a_net"], 1 / per_rank_nic)) if H > 1 else 0.0
    return rs, ar, rs


def schedule(stages: list[tuple[float, float, float]], check: float = 0.0) -> float:
    """End time of ringdp's _two_level schedule: one in-host stream running rs 0, rs 1,
    ag 0, rs 2, ag 1, ..., ag P-1; the inter-host all-reduces one after the other, piece i's
    starting when its reduce-scatter is done; ag i waits for all-reduce i. `check`: the call
    check's time, which starts with rs 0 and which the first all-reduce waits for."""
    host, net = 0.0, check
    done = []
    for i, (rs, ar, _) in enumerate(stages):
        host += rs
        net = max(host, net) + ar
        done.append(net)
        if i > 0:
            host = max(host, done[i - 1]) + stages[i - 1][2]
    return max(host, done[-1]) + stages[-1][2]


def two_level(S: float, H: int, hw: dict, piece_bytes: float | None = None, check: bool = False) -> float:
    """Two-level all-reduce of S bytes on H hosts x G GPUs. piece_bytes None: not pipelined
    (RS of S, all-reduce of S/G, AG of S, one after the other); else pieces of piece_bytes
    scheduled as ringdp does (stages on different resources overlap: NVLink for RS/AG, the
    NIC for the all-reduce; assumed independent). check: with the call check (call_check),
    beside the first reduce-scatter and before the first all-reduce; else the data's steps
    alone."""
    if H * hw["G"] <= 1:
        return 0.0
    return schedule([_stages(p, H, hw) for p in _pieces(S, piece_bytes)], call_check(H, hw) if check else 0.0)


PIECE_CHOICES = [MiB << k for k in range(0, 9)]  # 1 MiB .. 256 MiB


def best_piece(S: float, H: int, hw: dict) -> tuple[float, int]:
    best = (two_level(S, H, hw, None), int(S))
    for p in PIECE_CHOICES:
        if p < S:
            t = two_level(S, H, hw, p)
            if t < best[0]:
                best = (t, p)
    return best


def ringdp_piece(S: float, args) -> int:
    """The piece ringdp's two-level all-reduce uses for S bytes (policy.two_level_piece_bytes)."""
    return policy.two_level_piece_bytes(int(S), args.min_piece_bytes, args.max_pieces)


def args_hw(args, nic_case: str, **over) -> dict:
    """hw_params with the command line's machine (`over` replaces some of it)."""
    p = dict(nvlink_busbw_GBps=args.nvlink_busbw, nic_GBps=args.nic_GBps, alpha_nvlink_us=args.alpha_nvlink_us,
             alpha_net_us=args.alpha_net_us, launch_us=args.launch_us, alpha_check_us=args.alpha_check_us)
    return hw_params(nic_case, args.gpus_per_host, **dict(p, **over))


def project(args) -> dict:
    grid = []
    for case in NIC_CASES:
        hw = args_hw(args, case)
        for H in args.hosts:
            for S in DEFAULTS["sizes"]:
                flat = flat_ring(S, H, hw)
                unp = two_level(S, H, hw, None)
                piece = ringdp_piece(S, args)
                pip = two_level(S, H, hw, piece)
                checked = two_level(S, H, hw, piece, check=True)
                fixed = two_level(S, H, hw, args.fixed_piece_bytes)
                bt, bp = best_piece(S, H, hw)
                N = H * hw["G"]
                grid.append({"nic_case": case, "hosts": H, "gpus": N, "size": int(S),
                             "piece_bytes": int(min(S, piece)), "pieces": len(_pieces(S, piece)),
                             "flat_us": flat * 1e6, "two_level_us": pip * 1e6, "two_level_fixed_piece_us": fixed * 1e6,
                             "two_level_unpipelined_us": unp * 1e6,
                             "two_level_best_piece_us": bt * 1e6, "best_piece_bytes": bp,
                             "two_level_checked_us": checked * 1e6, "check_us": call_check(H, hw) * 1e6,
                             "speedup": flat / pip, "speedup_checked": flat / checked,
                             "speedup_fixed_piece": flat / fixed,
                             "speedup_unpipelined": flat / unp, "speedup_best_piece": flat / bt,
                             "flat_busbw_GBps": 2 * (N - 1) / N * S / flat / GB,
                             "two_level_busbw_GBps": 2 * (N - 1) / N * S / pip / GB})
    return {"grid": grid, "check_sensitivity": check_sensitivity(args)}


CHECK_SIZES = [MiB << k for k in range(0, 7, 2)]  # 1, 4, 16, 64 MiB: where the check weighs


def check_sensitivity(args) -> list[dict]:
    """The speedup with the call check for each step latency of DEFAULTS' range, in each of
    CHECK_SHAPES, ringdp's pieces, the grid's hosts, both NIC cases, at CHECK_SIZES (above
    them it weighs little)."""
    rows = []
    for case in NIC_CASES:
        for a in DEFAULTS["alpha_check_range_us"]:
            for shape in CHECK_SHAPES:
                hw = dict(args_hw(args, case, alpha_check_us=a), check_shape=shape)
                for H in args.hosts:
                    for S in CHECK_SIZES:
                        flat = flat_ring(S, H, hw)
                        rows.append({"nic_case": case, "alpha_check_us": a, "check_shape": shape,
                                     "hosts": H, "size": int(S), "check_us": call_check(H, hw) * 1e6,
                                     "speedup_checked": flat / two_level(S, H, hw, ringdp_piece(S, args), check=True),
                                     "speedup": flat / two_level(S, H, hw, ringdp_piece(S, args))})
    return rows


PIECE_COUNTS = [1, 2, 3, 4, 8]


def compare_piece_rules(args, hosts=range(2, 17)) -> list[dict]:
    """How close each rule comes to the model's best piece: max(minimum, ceil(S / k)) for k in
    PIECE_COUNTS, and fixed pieces, over H = 2..16 hosts, both NIC cases and every size of the
    grid; time with the rule / time with the best piece: geometric mean, worst, and the share
    of cells within 5%. policy.HIER_MAX_PIECES is chosen from this."""
    rules = [(f"max({size_name(args.min_piece_bytes)}, S/{k})", k,
              lambda S, k=k: policy.two_level_piece_bytes(int(S), args.min_piece_bytes, k)) for k in PIECE_COUNTS]
    rules.append((f"fixed {size_name(args.fixed_piece_bytes)}", None, lambda S: args.fixed_piece_bytes))
    ratios = {name: [] for name, _, _ in rules}
    worst_at = {}
    for case in NIC_CASES:
        hw = args_hw(args, case)
        for H in hosts:
            for S in DEFAULTS["sizes"]:
                bt, _ = best_piece(S, H, hw)
                for name, _, rule in rules:
                    r = two_level(S, H, hw, rule(S)) / bt
                    ratios[name].append(r)
                    if r >= max(ratios[name]):
                        worst_at[name] = {"nic_case": case, "hosts": H, "size": int(S)}
    return [{"rule": name, "max_pieces": k, "cells": len(ratios[name]),
             "geomean_vs_best": float(np.exp(np.mean(np.log(ratios[name])))),
             "worst_vs_best": float(max(ratios[name])), "worst_at": worst_at[name],
             "within_5pct": float(np.mean(np.array(ratios[name]) <= 1.05)),
             "is_ringdp_default": k == args.max_pieces} for name, k, _ in rules]


def assumptions(args) -> dict:
    return {
        "gpus_per_host": args.gpus_per_host,
        "in_host_busbw_GBps": args.nvlink_busbw,
        "in_host_busbw_source": "NCCL ring all-reduce, 8x H100 SXM (nccl-tests issues 212, 272); assumed the "
                                "same for reduce-scatter and all-gather",
        "nic_GBps": args.nic_GBps,
        "nic_source": "400 Gb/s NDR gives 46-48 GB/s per NIC (NVIDIA in nccl-tests issue 290)",
        "nic_cases": NIC_CASES,
        "alpha_nvlink_us": args.alpha_nvlink_us, "alpha_net_us": args.alpha_net_us, "launch_us": args.launch_us,
        "alpha_source": "NCCL src/graph/tuning.cc, ring, Simple protocol: hwLat NVLink 3.4 us, NET 9.6 us, "
                        "baseLat 8.4 us; a flat ring's latency = base + (2(N-1) - 2(H-1)) x NVLink + 2(H-1) x NET",
        "flat_ring": "channels spread over the host's NICs: each host sends 2(N-1)/N S over its NICs, each GPU "
                     "(G-1)/G of its 2(N-1)/N S over NVLink; time = latency + the slower of the two",
        "two_level": "RS and AG at the in-host busbw, inter-host ring all-reduce of S/G among H ranks at "
                     "nics x nic_GBps / G per local rank; pipelined by ringdp's schedule, NVLink and NIC work "
                     "overlap fully (assumed: GPUDirect RDMA, no SM or memory contention), RS/AG serialised "
                     "on one in-host stream; every collective pays launch_us",
        "alpha_check_us": args.alpha_check_us,
        "call_check": "ringdp's call check, a gloo all-to-all of a row across the H hosts per call, alpha_check_us "
                      "+ (H-1) x check_msg_us (before 2026-12-05 a ring all-gather, (H-1) x alpha_check_us), "
                      "on the issuing thread beside the first in-host reduce-scatter; the first inter-host "
                      "all-reduce waits for it (speedup_checked; speedup: the data's steps alone). alpha_check_us "
                      f"assumed {DEFAULTS['alpha_check_us']:g} (a kernel TCP message and gloo's handling), "
                      f"sensitivity over {DEFAULTS['alpha_check_range_us']} us; gloo issue 158 measured ~177 us "
                      "a step over TCP between 2 hosts (2018)",
        "not_modelled": "NCCL tree, NVLS, SHARP/CollNet and PAT (NCCL picks them for small messages or at "
                        "scale; this compares against the ring only); congestion in the network fabric",
        "pieces": f"ringdp's default: policy.two_level_piece_bytes (at most {args.max_pieces} pieces of at least "
                  f"{size_name(args.min_piece_bytes)}); for comparison fixed {size_name(args.fixed_piece_bytes)} "
                  "pieces (the rule before), the best piece of 1 MiB..256 MiB or one piece, and unpipelined",
    }


# ----------------------------------------------------------------------------- output
def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def size_name(S: int) -> str:
    return f"{S >> 30} GiB" if S >= 1 << 30 else f"{S >> 20} MiB"


def print_report(out: dict, file=sys.stdout) -> None:
    p = lambda s="": print(s, file=file)  # noqa: E731
    p("## fits on the 2-core box: time = alpha + beta * S (least squares on relative errors)")
    p(f"({FIT_RANGE_WHY})")
    p("| component | rows | alpha | beta (GB/s) | rms / max rel. err | rms all sizes |")
    p("|---|---|---|---|---|---|")
    for name, f in out["fits"].items():
        p(f"| {name}: {f['what']} | {size_name(f['min_bytes'])}-{size_name(f['max_bytes'])} ({f['rows']}) | "
          f"{f['alpha_s'] * 1e6:.1f} us | {f['beta_s_per_byte'] * 1e9:.3f} ns/B ({f['GBps']:.2f}) | "
          f"{f['rms_rel_err']:.0%} / {f['max_rel_err']:.0%} | {f['rms_rel_err_all_sizes']:.0%} |")
    c = out["contention"]
    p()
    p(f"contention factors (4 processes on 2 cores vs the 2-rank runs): nominal shm {c['nominal']['shm']:.2f}, "
      f"gloo {c['nominal']['gloo']:.2f}; calibrated shm {c['calibrated']['shm']:.2f}, "
      f"gloo {c['calibrated']['gloo']:.2f}")
    p()
    p("## predicted vs measured, allreduce_cpu_w4_float32_hosts2.json (2 hosts x 2 ranks, no overlap)")
    p("| size (piece) | two-level measured | predicted, nominal (err) | predicted, calibrated (err) | of which gloo "
      "| flat gloo measured | predicted, nominal (err) |")
    p("|---|---|---|---|---|---|---|")
    for r in out["validation"]:
        p(f"| {size_name(r['size'])} ({size_name(r['piece_bytes'])}) | {fmt_ms(r['two_level_measured_s'])} | "
          f"{fmt_ms(r['two_level_pred_nominal_s'])} "
          f"({r['two_level_err_nominal']:+.0%}) | {fmt_ms(r['two_level_pred_calibrated_s'])} "
          f"({r['two_level_err_calibrated']:+.0%}) | {fmt_ms(r['two_level_gloo_part_calibrated_s'])} | "
          f"{fmt_ms(r['flat_gloo_measured_s'])} | {fmt_ms(r['flat_gloo_pred_nominal_s'])} "
          f"({r['flat_gloo_err_nominal']:+.0%}) |")
    s = out["validation_summary"]
    p()
    p(f"two-level, 16 MiB-256 MiB: calibrated within {s['two_level_calibrated_max_abs_err']:.0%}, nominal within "
      f"{s['two_level_nominal_max_abs_err']:.0%}")
    p()
    p(f"## the same component fits against every --hosts 2 run committed ({HOSTS2_RUNS}); each run's own "
      "flat gloo fit and memcpy probe calibrate its factors; a run that timed its steps alone (--series parts) "
      "also gives factors from them (steps_factors)")
    p("| run | memcpy per rank, 4 at once | calibrated shm / gloo | two-level within, calibrated / nominal "
      "| flat gloo within, nominal | from its steps: shm / gloo, two-level within |")
    p("|---|---|---|---|---|---|")
    for v in out["validation_runs"]:
        c, st = v["contention_calibrated"], v["contention_steps"]
        steps = ("-" if st is None else
                 f"{st['shm']:.2f} / {st['gloo']:.2f}, {v['two_level_steps_max_abs_err']:.0%}")
        p(f"| {v['file']}{' (fitted)' if v['fitted'] else ''} | {v['memcpy_GBps_per_rank']:.1f} GB/s | "
          f"{c['shm']:.2f} / {c['gloo']:.2f} | {v['two_level_calibrated_max_abs_err']:.0%} / "
          f"{v['two_level_nominal_max_abs_err']:.0%} | {v['flat_gloo_nominal_max_abs_err']:.0%} | {steps} |")
    k = out["link"]
    h = k["hw"]
    p()
    p(f"## the projection's formulas on a shaped link, {k['file']} ({k['network']})")
    p(f"(G = 2, one NIC per host = the link, {k['rate_Bps'] / 1e6:.0f} MB/s; in-host {h['b_nv'] / GB:.2f} GB/s, "
      f"{h['a_nv'] * 1e6:.0f} us a step; network {h['a_net'] * 1e6:.0f} us a step; bytes bound on the speedup "
      f"{k['bytes_bound_speedup']:.2f}x)")
    p("| size (pieces) | flat gloo measured | flat_ring predicted (err) | two-level measured | two_level predicted "
      "(err) | speedup measured / predicted |")
    p("|---|---|---|---|---|---|")
    for r in k["rows"]:
        p(f"| {size_name(r['size'])} ({r['pieces']}) | {fmt_ms(r['flat_measured_s'])} | {fmt_ms(r['flat_pred_s'])} "
          f"({r['flat_err']:+.0%}) | {fmt_ms(r['two_level_measured_s'])} | {fmt_ms(r['two_level_pred_s'])} "
          f"({r['two_level_err']:+.0%}) | {r['speedup_measured']:.2f}x / {r['speedup_pred']:.2f}x |")
    p()
    p(f"16 MiB and up: within {k['max_abs_err_from_16MiB']:.0%}")
    a = out["args"]
    fixed = size_name(a["fixed_piece_bytes"])
    for case, what in NIC_CASES.items():
        p()
        p(f"## projection, {what}: flat ring / two-level with ringdp's pieces (at most {a['max_pieces']} of at "
          f"least {size_name(a['min_piece_bytes'])}) (ms), **speedup**; [with {fixed} pieces; with the best "
          "piece (size)]")
        hosts = a["hosts"]
        p("| size (ringdp's piece) | " + " | ".join(f"H={H} ({H * a['gpus_per_host']} GPUs)" for H in hosts) + " |")
        p("|---|" + "---|" * len(hosts))
        for S in DEFAULTS["sizes"][::2]:
            cells = []
            for H in hosts:
                g = next(x for x in out["grid"] if x["nic_case"] == case and x["hosts"] == H and x["size"] == S)
                cells.append(f"{g['flat_us'] / 1e3:.2f} / {g['two_level_us'] / 1e3:.2f}, **{g['speedup']:.2f}x** "
                             f"[{g['speedup_fixed_piece']:.2f}x; {g['speedup_best_piece']:.2f}x, "
                             f"{size_name(g['best_piece_bytes'])}]")
            g = next(x for x in out["grid"] if x["nic_case"] == case and x["size"] == S)
            p(f"| {size_name(S)} ({g['pieces']} x {size_name(g['piece_bytes'])}) | " + " | ".join(cells) + " |")
    p()
    p("## with the call check (gloo across the hosts, beside the first in-host step): speedup with ringdp's "
      "pieces for each step latency of the check, [the data's steps alone]; as ringdp sends it (an all-to-all: "
      "one step), then as a ring all-gather (H-1 steps, ringdp before 2026-12-05)")
    for (case, what), shape in ((c, s) for c in NIC_CASES.items() for s in CHECK_SHAPES):
        rows = [r for r in out["check_sensitivity"] if r["nic_case"] == case and r["check_shape"] == shape]
        alphas = sorted({r["alpha_check_us"] for r in rows})
        p()
        p(f"**{what}; {'the check as a ring all-gather (before); ' if shape == 'ring' else ''}a step of the check: "
          + " / ".join(f"{a:g} us" for a in alphas) + "**")
        p()
        p("| size | " + " | ".join(f"H={H}" for H in a["hosts"]) + " |")
        p("|---|" + "---|" * len(a["hosts"]))
        for S in CHECK_SIZES:
            cells = []
            for H in a["hosts"]:
                hs = sorted((r for r in rows if r["hosts"] == H and r["size"] == S), key=lambda r: r["alpha_check_us"])
                cells.append(" / ".join(f"{r['speedup_checked']:.2f}x" for r in hs) + f" [{hs[0]['speedup']:.2f}x]")
            p(f"| {size_name(S)} | " + " | ".join(cells) + " |")
    p()
    p("## piece rules against the model's best piece, H = 2..16, both NIC cases, 1 MiB-1 GiB: time with the rule / "
      "time with the best piece")
    p("| rule | geometric mean | worst (where) | cells within 5% |")
    p("|---|---|---|---|")
    for r in out["piece_rules"]:
        w = r["worst_at"]
        p(f"| {r['rule']}{' (ringdp)' if r['is_ringdp_default'] else ''} | {r['geomean_vs_best']:.3f} | "
          f"{r['worst_vs_best']:.2f} ({size_name(w['size'])}, H={w['hosts']}, {w['nic_case']}) | "
          f"{r['within_5pct']:.0%} |")


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for ax, (case, what) in zip(axes, NIC_CASES.items()):
        for i, H in enumerate(out["args"]["hosts"]):
            rows = sorted((x for x in out["grid"] if x["nic_case"] == case and x["hosts"] == H),
                          key=lambda x: x["size"])
            xs = [x["size"] / MiB for x in rows]
            line, = ax.plot(xs, [x["speedup"] for x in rows], marker="o", label=f"H={H}, ringdp default")
            ax.plot(xs, [x["speedup_checked"] for x in rows], ls="--", color=line.get_color(), alpha=0.6,
                    label=f"H={H}, with the call check")
            ax.plot(xs, [x["speedup_best_piece"] for x in rows], ls=":", color=line.get_color(),
                    label=f"H={H}, best piece")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("all-reduce size (MiB)")
        ax.set_title(what, fontsize=10)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup of two-level over flat ring")
    axes[1].legend(fontsize=6.5, ncol=2)
    fig.suptitle(f"Model: {out['args']['gpus_per_host']} H100 per host, in-host {out['args']['nvlink_busbw']:g} GB/s, "
                 f"NIC {out['args']['nic_GBps']:g} GB/s, ringdp's pieces: at most {out['args']['max_pieces']} of at least "
                 f"{size_name(out['args']['min_piece_bytes'])}; call check {out['args']['alpha_check_us']:g} us "
                 "a host (bench/cost_model.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results",
                    help="folder of the benchmark JSONs read (relative to the repository root)")
    ap.add_argument("--out-dir", default="bench/out", help="where the JSON and PNG go")
    ap.add_argument("--min-piece-bytes", type=count(1), default=DEFAULTS["min_piece_bytes"],
                    help="ringdp's minimum piece (RINGDP_HIER_PIECE_BYTES; default policy.HIER_PIECE_BYTES)")
    ap.add_argument("--max-pieces", type=count(1), default=DEFAULTS["max_pieces"],
                    help="ringdp's piece count (default policy.HIER_MAX_PIECES)")
    ap.add_argument("--fixed-piece-bytes", type=count(1), default=DEFAULTS["fixed_piece_bytes"],
                    help="the fixed piece compared against (the rule before policy.two_level_piece_bytes)")
    ap.add_argument("--gpus-per-host", type=count(1), default=DEFAULTS["gpus_per_host"])
    ap.add_argument("--hosts", type=counts, default=DEFAULTS["hosts"])
    ap.add_argument("--nvlink-busbw", type=positive, default=DEFAULTS["nvlink_busbw_GBps"], help="GB/s")
    ap.add_argument("--nic-GBps", type=positive, default=DEFAULTS["nic_GBps"])
    ap.add_argument("--alpha-nvlink-us", type=float, default=DEFAULTS["alpha_nvlink_us"])
    ap.add_argument("--alpha-net-us", type=float, default=DEFAULTS["alpha_net_us"])
    ap.add_argument("--launch-us", type=float, default=DEFAULTS["launch_us"])
    ap.add_argument("--alpha-check-us", type=float, default=DEFAULTS["alpha_check_us"],
                    help="the call check's gloo step between hosts (us)")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def run(args) -> dict:
    results = Path(args.results)
    if not results.is_absolute():
        results = ROOT / results
    fits, docs = fit_components(results)
    factors = contention_factors(fits, docs)
    val = validate(docs[COMPONENTS["gloo4_flat"][0]], fits, factors)
    out = {"benchmark": "cost_model", "args": vars(args), "fits": fits, "fit_ranges": FIT_RANGE_WHY,
           "contention": factors, "validation": val, "validation_summary": validation_summary(val),
           "validation_runs": validate_runs(results, fits, docs),
           "link": validate_link(load(results / LINK_FILE), fits, factors),
           "assumptions": assumptions(args)}
    out.update(project(args))
    out["piece_rules"] = compare_piece_rules(args)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    od = Path(args.out_dir)
    od.mkdir(parents=True, exist_ok=True)
    print_report(out)
    (od / "cost_model_projection.json").write_text(json.dumps(out, indent=1))
    print(f"\nwrote {od / 'cost_model_projection.json'}")
    if not args.no_plot:
        plot(out, od / "cost_model_projection.png")
        print(f"wrote {od / 'cost_model_projection.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
