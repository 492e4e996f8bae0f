"""Print the README's results tables (markdown) and each file's summary from result JSON files.

    python bench/readme_table.py                      # every file in bench/results
    python bench/readme_table.py bench/out/*.json     # given files
    python bench/readme_table.py --no-summary > /tmp/table.md

allreduce_*.json and {reduce_scatter,all_gather,broadcast}_*.json (bench/allreduce.py --coll): a table of time, busbw and speedup per size and
series, or, for a run with forced algorithms (--algo ring,oneshot), the median time per
algorithm; then the summary (bench/report.py): speedups by size range, the issue's
targets, the ring/one-shot crossover and suggested threshold. ddp_step*.json
(bench/ddp_step.py): its rows. The world size is the one measured (machine.world_size). A
file of a run that did not finish says INCOMPLETE after its name (and gets no targets).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR as RESULTS, result_file  # noqa: E402
from report import complete, load, summary_lines, world_of  # noqa: E402


def fmt_size(b: int) -> str:
    """A size in whole MiB or KiB, else in bytes (world 3's sizes, whole chunks: 4092 B)."""
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"


def title(path: Path, d: dict) -> str:
    """The file's name, and INCOMPLETE for a run that stopped before its end (its targets are
    not judged: report.targets)."""
    return f"**{path.name}**" + ("" if complete(d) else " INCOMPLETE (the run did not finish)")


def allreduce_table(path: Path, d: dict) -> str:
    m = d["machine"]
    rows = d["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["size"], {})[r["series"]] = r
    series = [s for s in dict.fromkeys(r["series"] for r in rows) if s.startswith("ringdp")]
    base = next((r["series"] for r in rows if r["kind"] == "baseline"), None)
    where = (f"{m['cpu_model']} ({m['cpu_cores']} cores)" if d["args"]["device"] == "cpu"
             else f"{m.get('gpu', 'GPU')}, {d.get('transport', 'cuda')}")
    head = (f"{title(path, d)}: world {world_of(d)}, {d['args']['dtype']}, {where}, torch {m['torch']}; "
            f"memcpy {d['memcpy']['one_rank_GBps']:.1f} GB/s; #wrong total {d['total_wrong']}\n\n")
    cols = ["size"] + ([f"{base} us", f"{base} busbw"] if base else [])
    cols += [c for s in series for c in (f"{s} us", f"{s} busbw") + ((f"{s} speedup",) if base else ())]
    out = head + "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for size in sorted(by):
        v = by[size]
        cells = [fmt_size(size)]
        if base:
            b = v.get(base)
            cells += [f"{b['time_us']:.1f}", f"{b['busbw_GBps']:.2f}"] if b else ["-", "-"]
        for s in series:
            r = v.get(s)
            n = 3 if base else 2
            if r is None:
                cells += ["-"] * n
                continue
            cells += [f"{r['time_us']:.1f}", f"{r['busbw_GBps']:.2f}"]
            if base:
                cells.append(f"{r['speedup']:.1f}x" if r.get("speedup") else "-")
        out += "| " + " | ".join(cells) + " |\n"
    return out


def threshold_table(path: Path, d: dict) -> str:
    """Median time per forced algorithm: where one-shot stops paying (ringdp/policy.py)."""
    by, series = {}, []
    for r in d["rows"]:
        by.setdefault(r["size"], {})[r["series"]] = r["median_us"]
        if r["series"] not in series:
            series.append(r["series"])
    out = f"{title(path, d)}: world {world_of(d)}, median us per call\n\n"
    out += "| size | " + " | ".join(series) + " |\n|" + "---|" * (len(series) + 1) + "\n"
    for size in sorted(by):
        out += f"| {fmt_size(size)} | " + " | ".join(
            f"{by[size][s]:.1f}" if s in by[size] else "-" for s in series) + " |\n"
    return out


def ddp_table(path: Path, d: dict) -> str:
    out = f"{title(path, d)}\n\n"
    rows = d.get("rows") or d.get("results") or []
    if not rows:
        return out + "(no rows)\n"
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    out += "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n"
    for r in rows:
        out += "| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |\n"
    return out


def render(path: Path, summary: bool = True) -> str:
    d = load(path)
    if d.get("benchmark") == "allreduce" or path.name.startswith("allreduce_") or d.get("collective"):
        forced = len(d["args"].get("algos", [d["args"].get("algo")])) > 1
        text = threshold_table(path, d) if forced else allreduce_table(path, d)
        if summary:
            lines = summary_lines(d)
            if lines:
                text += "\n" + "".join(f"- {line}\n" for line in lines)
        return text
    return ddp_table(path, d)


def default_files(results: Path) -> list[Path]:
    colls = [p for c in ("reduce_scatter", "all_gather", "broadcast") for p in sorted(results.glob(f"{c}_*.json"))]
    return sorted(results.glob("allreduce_*.json")) + colls + sorted(results.glob("ddp_step*.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=result_file,
                    help="result JSON files (default: allreduce_*.json and ddp_step*.json in --results)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files (default bench/results)")
    ap.add_argument("--no-summary", action="store_true", help="tables only, no summary lines")
    a = ap.parse_args(argv)
    files = a.files or default_files(a.results)
    if not files:
        ap.error(f"no result files in {a.results}")
    for f in files:
        print(render(f, summary=not a.no_summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
