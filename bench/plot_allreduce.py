"""Plot all-reduce benchmark results written by bench/allreduce.py.

    python bench/plot_allreduce.py RESULT.json [MORE.json ...] [-o out.png]

With one file it redraws that run. With several (for example a run with --algo ring and
one with --algo oneshot) it draws every series of every file on the same axes, labelled
by file, and prints where each ringdp series overtakes the others (the size at which the
faster algorithm changes), which is how the one-shot threshold is read off.

Left panel: busbw (GB/s) against message size, log-log. Right panel: time per
all-reduce (us) against size, with the roofline time of each ringdp series dashed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import result_file  # noqa: E402
from report import crossovers, human_bytes, series_rows, world_of  # noqa: E402


def plot_runs(runs: list[tuple[str, dict]], png: Path | str) -> Path:
    """Draw busbw and time against size for every series of every run; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5.2))
    sizes_seen: set[int] = set()
    for label, payload in runs:
        for name, rows in series_rows(payload["rows"]).items():
            full = f"{name} ({label})" if label else name
            xs = [r["size"] for r in rows]
            sizes_seen.update(xs)
            marker = "o" if name.startswith("ringdp") else "s"
            style = "-" if name.startswith("ringdp") else "--"
            ax_bw.plot(xs, [r["busbw_GBps"] for r in rows], style, marker=marker, ms=4, label=full)
            line, = ax_t.plot(xs, [r["time_us"] for r in rows], style, marker=marker, ms=4, label=full)
            if name.startswith("ringdp") and any(r.get("roof_us") for r in rows):
                ax_t.plot(xs, [r.get("roof_us") or float("nan") for r in rows], ":",
                          color=line.get_color(), lw=1, label=f"{full} roofline")
    first = runs[0][1]
    machine = first.get("machine", {})
    args = first.get("args", {})
    coll = first.get("collective", "all_reduce")
    title = (f"{coll} {args.get('dtype', '?')} {args.get('op', '?')}, world {world_of(first) or '?'}, "
             f"{machine.get('device', '?')}: {machine.get('gpu') or machine.get('cpu_model', '')} "
             f"({machine.get('cpu_cores', '?')} cores), torch {machine.get('torch', '?')}")
    if first.get("cross_path"):  # across hosts: how many, and what joins them
        title += f"\n{len(set(first.get('hosts') or []))} hosts ({first['cross_path']})"
        title += f", {machine['network']}" if machine.get("network") else ", simulated (RINGDP_HOST_ID), loopback"
    fig.suptitle(title, fontsize=9)
    ticks = sorted(sizes_seen)
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_bytes(s) for s in ticks], rotation=45, ha="right", fontsize=7)
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("busbw (GB/s) = S/t * " + {"all_reduce": "2(n-1)/n", "broadcast": "1"}.get(coll, "(n-1)/n"))
    ax_bw.set_title("bus bandwidth (higher is better)", fontsize=9)
    ax_t.set_ylabel(f"time per {coll} (us)")
    ax_t.set_title("latency (lower is better)", fontsize=9)
    ax_bw.legend(fontsize=7)
    ax_t.legend(fontsize=6)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=result_file, help="result files from bench/allreduce.py")
    ap.add_argument("-o", "--out", help="PNG path (default: next to the first file)")
    a = ap.parse_args(argv)
    runs = []
    for p in a.json:
        payload = json.loads(Path(p).read_text())
        label = Path(p).stem if len(a.json) > 1 else ""
        runs.append((label, payload))
    out = Path(a.out) if a.out else Path(a.json[0]).with_suffix(".png")
    print(f"wrote {plot_runs(runs, out)}")
    for line in crossovers(runs):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
