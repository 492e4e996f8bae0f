"""Compare benchmark results before and after a change: did anything get slower?

    python bench/compare.py --before OLD1.json OLD2.json --after NEW1.json NEW2.json

Each side is one or more result files of the same benchmark (bench/allreduce.py or
bench/ddp_step.py), ideally measured interleaved (before, after, before, after, ...) on one
quiet machine, since a 2-core box drifts from run to run. Per row (size and series, or
hidden size and mode) it takes each side's best run (the smallest time), and prints
before, after and after/before, then the same of each side's median run (the best run
alone says little when the runs spread as widely as the change); for all-reduce rows also
the speedup over the baseline measured in the same run, which cancels most of the
machine's drift. Rows present on one
side only are left out. All files must agree on the collective, world size, dtype, op and
device (recorded in the output's "facts"): a mix is refused, naming two files and the field.
--json writes the table as JSON (for bench/results/).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _common import result_file
from report import world_of

FACTS = ("collective", "world", "dtype", "op", "device")  # what every compared file must share


def _rows(path: Path) -> tuple[str, list[dict], dict]:
    """kind, rows, {fact: value} (FACTS; None where the file has no such field)."""
    d = json.loads(path.read_text())
    rows = d.get("rows") or d.get("results") or []
    kind = "ddp_step" if rows and "mode" in rows[0] else "allreduce"
    args = d.get("args", {})
    facts = {"collective": d.get("collective", "all_reduce") if kind == "allreduce" else None, "world": world_of(d),
             "dtype": args.get("dtype"), "op": args.get("op"), "device": args.get("device")}
    return kind, rows, facts


def _same_facts(files: list[Path]) -> dict:
    """The FACTS every file shares; SystemExit naming the first two files that differ and where."""
    first, facts = files[0], _rows(files[0])[2]
    for f in files[1:]:
        other = _rows(f)[2]
        for k in FACTS:
            if other[k] != facts[k]:
                raise SystemExit(f"{first} and {f} disagree on {k} ({facts[k]} vs {other[k]}): "
                                 "compare runs of one configuration")
    return facts


def _best(files: list[Path]) -> tuple[str, dict]:
    """kind, {row key: {"time": best time, "speedup": best speedup over the baseline,
    "times": every run's time}}"""
    kinds, best = set(), {}
    for f in files:
        kind, rows, _ = _rows(f)
        kinds.add(kind)
        for r in rows:
            if kind == "allreduce":
                key, t, sp = (r["size"], r["series"]), r["time_us"], r.get("speedup")
            else:
                key, t, sp = (r["hidden"], r["mode"]), r["step_ms"], None
            cur = best.setdefault(key, {"time": t, "speedup": sp, "times": []})
            cur["time"] = min(cur["time"], t)
            cur["times"].append(t)
            if sp is not None:
                cur["speedup"] = max(cur["speedup"] or 0.0, sp)
    if len(kinds) != 1:
        raise SystemExit(f"the files hold different benchmarks: {sorted(kinds)}")
    return kinds.pop(), best


def compare(before: list[Path], after: list[Path]) -> dict:
    kb, b = _best(before)
    ka, a = _best(after)
    if kb != ka:
        raise SystemExit(f"before is {kb}, after is {ka}: compare the same benchmark")
    facts = _same_facts(before + after)
    unit = "us" if kb == "allreduce" else "ms"
    rows = []
    for key in sorted(set(b) & set(a), key=lambda k: (str(k[1]), k[0])):
        row = {"key": list(key), f"before_{unit}": b[key]["time"], f"after_{unit}": a[key]["time"],
               "after_over_before": a[key]["time"] / b[key]["time"]}
        mb, ma = statistics.median(b[key]["times"]), statistics.median(a[key]["times"])
        row.update({f"before_median_{unit}": mb, f"after_median_{unit}": ma, "median_after_over_before": ma / mb,
                    "runs": [len(b[key]["times"]), len(a[key]["times"])]})
        if b[key]["speedup"] is not None and a[key]["speedup"] is not None:
            row["speedup_before"], row["speedup_after"] = b[key]["speedup"], a[key]["speedup"]
        rows.append(row)
    machine = json.loads(after[0].read_text()).get("machine")
    return {"benchmark": kb, "unit": unit, "facts": facts, "machine": machine, "before": [str(p) for p in before],
            "after": [str(p) for p in after], "rows": rows}


def format_table(c: dict) -> str:
    unit = c["unit"]
    first = "size, series" if c["benchmark"] == "allreduce" else "hidden, mode"
    out = [f"| {first} | before {unit} | after {unit} | after/before | medians: before, after, after/before "
           f"| speedup over baseline before -> after |", "|---|---|---|---|---|---|"]
    for r in c["rows"]:
        sp = (f"{r['speedup_before']:.1f}x -> {r['speedup_after']:.1f}x" if "speedup_before" in r else "-")
        out.append(f"| {r['key'][0]}, {r['key'][1]} | {r[f'before_{unit}']:.1f} | {r[f'after_{unit}']:.1f} | "
                   f"{r['after_over_before']:.2f} | {r[f'before_median_{unit}']:.1f}, {r[f'after_median_{unit}']:.1f}, "
                   f"{r['median_after_over_before']:.2f} | {sp} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", nargs="+", type=result_file, required=True, help="result files of the old code")
    ap.add_argument("--after", nargs="+", type=result_file, required=True, help="result files of the new code")
    ap.add_argument("--json", type=Path, help="also write the comparison here")
    args = ap.parse_args(argv)
    c = compare(args.before, args.after)
    print(format_table(c))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(c, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
