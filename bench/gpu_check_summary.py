"""The summary JSON of one bench/gpu_check.sh phase, from what the phase left in its folder.

    python3 bench/gpu_check_summary.py PHASE WORK_DIR OUT.json EXIT_CODE SECONDS

Reads WORK_DIR/steps.tsv (one line per step: name, exit code, seconds, status, command),
the logs, the junit XML of the tests and the benchmark JSON files, and writes OUT.json:

    phase, status (ok | failed | timeout | no_cuda), exit_code, seconds, steps, failed_steps
    build  facts (GPU, capability, torch, CUDA, NCCL, driver, nvcc, python packages),
           cuda_build (ringdp.build_info()["cuda"]), build_info, build_seconds, nccl_loadable
    priority, smoke, nccl, hosts, mps  tests {test id: passed | failed | error | skipped | timeout | not run},
           counts; mps: whether MPS was running
    bench  copy bandwidth (device copy_ and add_, bytes read + written), mps, and per
           benchmark file: complete (false: the sweep was cut short), transport, world,
           #wrong, per series: latency at 8 KiB, best
           busbw, %roof at >= 64 MiB (for the IPC ring: >= 70% is the target), speedup over
           the nccl baseline where it ran
    probe  per bench/cuda_probe.py file (one per RINGDP_CUDA_CHANNELS setting): the channel
           setting, the endpoint, latency and RingDDP step figures
    cpu    cpu_cores; the two-host sweep's speedup of each series over flat gloo per size
           (issue 12: >= 2x from 16 MiB, target_2x_ge_16MiB_met) and the two-level time over
           the sum of its steps timed alone (--series parts; two_level_over_parts); stock
           DDP's and RingDDP's step time over gloo DDP's per H (issue 11: torch_ringdp <=
           0.6x at H=2560, target_0.6x_met) and the floor torch_nocomm; FSDP2's over gloo's
           (aim <= 0.5x)

Everything is read defensively: a missing, truncated or malformed file becomes a string
saying so in its place, never an exception (a phase killed by its timeout still gets its
summary). Standard library only.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET


def read_text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def read_json(path: str):
    text = read_text(path)
    if text is None:
        return f"missing: {os.path.basename(path)}"
    try:
        return json.loads(text)
    except ValueError as e:
        return f"unreadable ({e}): {os.path.basename(path)}, {len(text)} bytes"


def read_steps(work: str) -> list[dict]:
    steps = []
    for line in (read_text(os.path.join(work, "steps.tsv")) or "").splitlines():
        parts = line.split("\t")
        if len(parts) < 4:
            continue
        try:
            rc, secs = int(parts[1]), int(parts[2])
        except ValueError:
            continue
        steps.append({"step": parts[0], "rc": rc, "seconds": secs, "status": parts[3],
                      "command": parts[4] if len(parts) > 4 else ""})
    # the step that was running when the phase was killed
    cur = (read_text(os.path.join(work, "current.step")) or "").rstrip("\n").split("\t")
    if len(cur) >= 3 and cur[0]:
        try:
            secs = int(time.time()) - int(cur[1])
        except ValueError:
            secs = -1
        steps.append({"step": cur[0], "rc": 124, "seconds": secs, "status": "killed", "command": cur[2]})
    return steps


def last_json_line(text: str | None):
    """The last line of a log that parses as a JSON object (a step that prints one)."""
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ------------------------------------------------------------------ phases
def build_summary(work: str, steps: list[dict]) -> dict:
    out: dict = {}
    facts = read_json(os.path.join(work, "facts.json"))
    out["facts"] = facts
    smi = read_text(os.path.join(work, "nvidia_smi.log")) or ""
    m = re.search(r"Driver Version:\s*([\d.]+)", smi)
    out["driver"] = m.group(1) if m else None
    nvcc = read_text(os.path.join(work, "nvcc.log")) or ""
    m = re.search(r"release ([\d.]+)", nvcc)
    out["nvcc"] = m.group(1) if m else None
    cuda_device = isinstance(facts, dict) and bool(facts.get("cuda_available"))
    info = last_json_line(read_text(os.path.join(work, "build_info.log")))
    out["build_info"] = info
    out["cuda_build"] = bool(isinstance(info, dict) and info.get("cuda"))
    by = {s["step"]: s for s in steps}
    if "build" in by:
        out["build_seconds"] = by["build"]["seconds"]
    if "nccl_loadable" in by:
        out["nccl_loadable"] = by["nccl_loadable"]["rc"] == 0
    if not cuda_device:
        out["error"] = "CUDA is missing: no CUDA device visible to torch (nothing was built)"
    elif not out["cuda_build"]:
        out["error"] = "CUDA is missing from ringdp: build_info()['cuda'] is not True (see build.log)"
    return out


def junit_outcomes(path: str) -> dict[str, str]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out = {}
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        if case.find("failure") is not None:
            out[name] = "failed"
        elif case.find("error") is not None:
            out[name] = "error"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


RESULT_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED)\s+(?:\[\d+\]\s+)?tests/test_cuda\.py::(\S+)")


def tests_summary(work: str, steps: list[dict]) -> dict:
    tests: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for s in steps:
        m = re.search(r"tests/test_cuda\.py::(\S+)", s["command"])
        if not m or not s["step"].startswith("test_"):
            continue
        tid = m.group(1)
        got = junit_outcomes(os.path.join(work, f"{s['step']}.xml"))
        log = read_text(os.path.join(work, f"{s['step']}.log")) or ""
        if got:
            outcome = next(iter(got.values()))
        else:  # killed before pytest wrote its XML: the log's -rA lines, else the step
            found = [mm.group(1).lower() for mm in map(RESULT_LINE.match, log.splitlines()) if mm]
            outcome = found[-1] if found else ("timeout" if s["status"] in ("timeout", "killed")
                                               else "not run" if s["status"] == "skipped" else "error")
        tests[tid] = outcome
        if outcome not in ("passed", "not run"):
            lines = [ln for ln in log.splitlines() if ln.strip()]
            hint = [ln for ln in lines if re.search(r"Error|assert|Failed|FAILED|RingError", ln)]
            reasons[tid] = ((hint[-1] if hint else lines[-1]) if lines else "no output")[:300]
    counts: dict[str, int] = {}
    for v in tests.values():
        counts[v] = counts.get(v, 0) + 1
    return {"tests": tests, "counts": counts, "why_not_passed": reasons}


def bench_file_summary(path: str) -> dict | str:
    d = read_json(path)
    if not isinstance(d, dict):
        return d
    try:
        rows = d.get("rows", [])
        base = {r["size"]: r for r in rows if r.get("kind") == "baseline"}
        entry = {"complete": d.get("complete"), "transport": d.get("transport"),
                 "world": d.get("machine", {}).get("world_size"),
                 "total_wrong": d.get("total_wrong"), "memcpy_GBps": d.get("memcpy", {}).get("one_rank_GBps"),
                 "notes": d.get("notes", []), "series": {}}
        names = list(dict.fromkeys(r["series"] for r in rows))
        for name in names:
            rs = sorted((r for r in rows if r["series"] == name), key=lambda r: r["size"])
            e: dict = {"sizes": len(rs), "busbw_max_GBps": round(max(r["busbw_GBps"] for r in rs), 2)}
            small = [r for r in rs if r["size"] == 8192]
            if small:
                e["latency_8KiB_us"] = round(small[0]["time_us"], 2)
            big = [r["pct_roof"] for r in rs if r["size"] >= (64 << 20) and r.get("pct_roof") is not None]
            if big:
                e["pct_roof_ge_64MiB"] = {"min": round(min(big), 1), "max": round(max(big), 1)}
                if d.get("transport") == "ipc" and name.startswith("ringdp"):
                    e["target_70pct_met"] = min(big) >= 70.0
            sp = {r["size"]: r["time_us"] for r in rs}
            if base and name not in {b["series"] for b in base.values()}:
                ratio = {z: base[z]["time_us"] / t for z, t in sp.items() if z in base and t > 0}
                if ratio:
                    e["speedup_vs_baseline"] = {"min": round(min(ratio.values()), 2),
                                                "max": round(max(ratio.values()), 2)}
            algos = sorted({r.get("algo", "?") for r in rs})
            e["algos"] = algos
            e["wrong"] = sum(int(r.get("wrong", 0)) for r in rs)
            entry["series"][name] = e
        return entry
    except (KeyError, TypeError, ValueError) as e:
        return f"unexpected content ({type(e).__name__}: {e}): {os.path.basename(path)}"


def bench_summary(work: str, steps: list[dict]) -> dict:
    out: dict = {}
    cb = read_json(os.path.join(work, "copy_bw.json"))
    if isinstance(cb, dict):
        out["copy_GBps"] = cb.get("copy_GBps")
        out["add_GBps"] = (cb.get("add_") or {}).get("GBps")
    else:
        out["copy_GBps"] = cb
    out["sweeps"] = {os.path.basename(f)[:-5]: bench_file_summary(f)
                     for f in sorted(glob.glob(os.path.join(work, "bench", "*.json")))}
    return out


PROBE_KEYS = ("channels_setting", "endpoint", "mps", "native_host_us", "ringdp_host_us", "native_pipelined_us",
              "ringdp_pipelined_us", "ringdp_roundtrip_us", "none_ms", "ring_ms", "exposed_ms",
              "last_exposed_comm_ms", "allreduce_alone_ms", "none_host_ms", "ring_host_ms", "ring_no_kernels_ms",
              "ring_no_overlap_ms", "ring_device_allocs", "breakdown_error")


def probe_summary(work: str) -> dict:
    """probe: per cuda_probe file, its key figures (a damaged file: what read_json says)."""
    out: dict = {}
    for f in sorted(glob.glob(os.path.join(work, "probe", "*.json"))):
        d = read_json(f)
        out[os.path.basename(f)[:-5]] = ({k: d.get(k) for k in PROBE_KEYS} if isinstance(d, dict) else d)
    return {"probes": out}


def hosts_sweep_summary(path: str) -> dict | str:
    """A --hosts all-reduce sweep: each series' speedup over the baseline (flat gloo) per size."""
    d = read_json(path)
    if not isinstance(d, dict):
        return d
    try:
        rows = d.get("rows", [])
        base = {r["size"]: r["time_us"] for r in rows if r.get("kind") == "baseline"}
        out: dict = {"complete": d.get("complete"), "hosts": d.get("hosts"), "cross_path": d.get("cross_path"),
                     "total_wrong": d.get("total_wrong"), "cpu_cores": d.get("machine", {}).get("cpu_cores"),
                     "speedup": {}}
        for r in rows:
            if r.get("kind") != "baseline" and r["size"] in base and r["time_us"] > 0:
                out["speedup"].setdefault(r["series"], {})[str(r["size"])] = round(base[r["size"]] / r["time_us"], 2)
        big = [v for z, v in out["speedup"].get("ringdp", {}).items() if int(z) >= (16 << 20)]
        out["target_2x_ge_16MiB_met"] = bool(big) and min(big) >= 2.0
        # --series parts: the two-level time over the sum of its steps timed alone (below 1:
        # the pipeline hides part of one behind the other)
        t = {(r["series"], r["size"]): r["time_us"] for r in rows}
        out["two_level_over_parts"] = {
            str(z): round(t["ringdp", z] / (t["part:inhost", z] + t["part:cross", z]), 2)
            for (name, z) in t if name == "part:inhost" and ("part:cross", z) in t and ("ringdp", z) in t}
        return out
    except (KeyError, TypeError, ValueError) as e:
        return f"unexpected content ({type(e).__name__}: {e}): {os.path.basename(path)}"


def step_ratios(path: str, base_mode: str, key: str | None) -> dict | str:
    """ddp_step / fsdp_step: every mode's median step time over base_mode's, per `key` (H)."""
    d = read_json(path)
    if not isinstance(d, dict):
        return d
    try:
        groups: dict = {}
        for r in d.get("rows", []):
            groups.setdefault(str(r[key]) if key else "all", {})[r["mode"]] = r["step_ms"]
        out: dict = {"cpu_cores": d.get("machine", {}).get("cpu_cores"), "step_ms": groups, "ratio": {}}
        for g, modes in groups.items():
            if modes.get(base_mode):
                out["ratio"][g] = {m: round(t / modes[base_mode], 3) for m, t in modes.items() if m != base_mode}
        return out
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return f"unexpected content ({type(e).__name__}: {e}): {os.path.basename(path)}"


def cpu_summary(work: str) -> dict:
    out: dict = {}
    for f in sorted(glob.glob(os.path.join(work, "cpu", "*.json"))):
        name = os.path.basename(f)[:-5]
        if name.startswith("allreduce_"):
            out[name] = hosts_sweep_summary(f)
        elif name.startswith("ddp_step_"):
            e = step_ratios(f, "torch", "hidden")
            if isinstance(e, dict):
                r = e["ratio"].get("2560", {}).get("torch_ringdp")
                e["target_0.6x_met"] = None if r is None else r <= 0.6
            out[name] = e
        elif name.startswith("fsdp_step_"):
            e = step_ratios(f, "gloo", None)
            if isinstance(e, dict):
                r = e["ratio"].get("all", {}).get("ringdp")
                e["aim_0.5x_met"] = None if r is None else r <= 0.5
            out[name] = e
    return {"cpu": out}


def summarize(phase: str, work: str, rc: int, seconds: int) -> dict:
    steps = read_steps(work)
    if rc in (124, 137):
        status = "timeout"
    elif rc == 3:
        status = "no_cuda"
    elif rc == 0:
        status = "ok"
    else:
        status = "failed"
    s: dict = {"phase": phase, "status": status, "exit_code": rc, "seconds": seconds, "steps": steps,
               "failed_steps": [x["step"] for x in steps if x["status"] != "ok"]}
    mps = read_text(os.path.join(work, "mps_used"))
    if mps is not None:
        s["mps"] = mps.strip() == "1"
    try:
        if phase == "build":
            s.update(build_summary(work, steps))
        elif phase in ("priority", "smoke", "nccl", "hosts", "mps"):
            s.update(tests_summary(work, steps))
        elif phase == "bench":
            s.update(bench_summary(work, steps))
        elif phase == "probe":
            s.update(probe_summary(work))
        elif phase == "cpu":
            s.update(cpu_summary(work))
    except Exception as e:  # noqa: BLE001 -- the summary must be written whatever happened
        s["summary_error"] = f"{type(e).__name__}: {e}"
    if rc == 3 and "error" not in s:
        s["error"] = "CUDA is missing: no CUDA build of ringdp here (run the build phase first, same machine)"
    return s


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    phase, work, out, rc, seconds = argv
    s = summarize(phase, work, int(rc), int(seconds))
    with open(out, "w") as f:
        json.dump(s, f, indent=1)
        f.write("\n")
    brief = {k: v for k, v in s.items() if k not in ("steps", "sweeps", "facts", "probes")}
    print(json.dumps(brief, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
