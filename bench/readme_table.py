"""Print the README's results tables (markdown) from the JSON files in bench/results.

    python bench/readme_table.py > /tmp/table.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def fmt_size(b: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


def allreduce_table(path: Path) -> str:
    d = json.loads(path.read_text())
    m = d["machine"]
    rows = d["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["size"], {})[r["series"]] = r
    series = [s for s in ("ringdp", "ringdp-reg") if any(s in v for v in by.values())]
    base = next((r["series"] for r in rows if r["kind"] == "baseline"), None)
    head = (f"**{path.name}**: world {d['args']['world']}, {d['args']['dtype']}, {m['cpu_model']} "
            f"({m['cpu_cores']} cores), torch {m['torch']}; memcpy {d['memcpy']['one_rank_GBps']:.1f} GB/s; "
            f"#wrong total {d['total_wrong']}\n\n")
    cols = ["size", f"{base} us", f"{base} busbw"] + [c for s in series for c in (f"{s} us", f"{s} busbw", f"{s} speedup")]
    out = head + "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for size in sorted(by):
        v = by[size]
        cells = [fmt_size(size)]
        b = v.get(base)
        cells += [f"{b['time_us']:.1f}", f"{b['busbw_GBps']:.2f}"] if b else ["-", "-"]
        for s in series:
            r = v.get(s)
            cells += [f"{r['time_us']:.1f}", f"{r['busbw_GBps']:.2f}", f"{r['speedup']:.1f}x"] if r else ["-"] * 3
        out += "| " + " | ".join(cells) + " |\n"
    return out


def threshold_table(path: Path) -> str:
    """Median time per forced algorithm: where one-shot stops paying (ringdp/policy.py)."""
    d = json.loads(path.read_text())
    by, series = {}, []
    for r in d["rows"]:
        by.setdefault(r["size"], {})[r["series"]] = r["median_us"]
        if r["series"] not in series:
            series.append(r["series"])
    out = f"**{path.name}**: world {d['args']['world']}, median us per call\n\n"
    out += "| size | " + " | ".join(series) + " |\n|" + "---|" * (len(series) + 1) + "\n"
    for size in sorted(by):
        out += f"| {fmt_size(size)} | " + " | ".join(
            f"{by[size][s]:.1f}" if s in by[size] else "-" for s in series) + " |\n"
    return out


def ddp_table(path: Path) -> str:
    d = json.loads(path.read_text())
    out = f"**{path.name}**\n\n"
    rows = d.get("rows") or d.get("results") or []
    if not rows:
        return out + "(no rows)\n"
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    out += "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    for r in rows:
        out += "| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |\n"
    return out


def main(argv):
    files = sorted(RESULTS.glob("allreduce_cpu_*.json"))
    for f in files:
        print(threshold_table(f) if "threshold" in f.name else allreduce_table(f))
    for f in sorted(RESULTS.glob("ddp_step*.json")):
        print(ddp_table(f))


if __name__ == "__main__":
    main(sys.argv[1:])
