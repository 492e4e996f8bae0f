"""Reading bench/allreduce.py results: summaries, the issue's targets, the one-shot crossover.

Pure functions of a result file's JSON (no torch, no ringdp), used by bench/readme_table.py
(which prints them for every result file) and bench/plot_allreduce.py:

    world_of(doc)          the world size that was measured (machine.world_size)
    speedup_lines(doc)     per ringdp series: speedup over the baseline, min..max, at
                           16-256 MiB (busbw), and at the smallest size (latency)
    targets(doc)           the issue's performance targets (2-core CPU, float32, vs gloo):
                           world 2: ordinary >= 3.5x and registered >= 6x gloo's busbw at
                           16-256 MiB, 4 KiB in <= 1/8 of gloo's time; world 4: faster than
                           gloo at every size; reduce_scatter and all_gather (--coll), world
                           2: >= 4x gloo's busbw at 16-256 MiB (issue 11); broadcast: none.
                           {name: met} (empty when they do not apply: a run that did not
                           complete, or not on one host alone: single_host)
    complete(doc)          whether the run finished (a file rewritten after every size says
                           "complete": false until then; older files say nothing: complete)
    single_host(doc)       whether the ranks ran on one host with nothing beside them (no
                           --hosts, torchrun across hosts or bench/netns_hosts.py, no --busy)
    crossovers(runs)       sizes at which the faster of two ringdp series changes
    oneshot_suggestion(doc) with --algo ring,oneshot: up to which size one-shot beats the
                           ring (each tensor kind) and the ONESHOT_MAX_BYTES that follows
    summary_lines(doc)     all of the above as text lines
"""
from __future__ import annotations

import json
from pathlib import Path

MiB = 1 << 20


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"


def load(path: Path | str) -> dict:
    return json.loads(Path(path).read_text())


def world_of(doc: dict) -> int | None:
    """The world size of the process group that ran (older files: the --world argument)."""
    w = doc.get("machine", {}).get("world_size")
    return w if w is not None else doc.get("args", {}).get("world")


def complete(doc: dict) -> bool:
    return doc.get("complete") is not False


def single_host(doc: dict) -> bool:
    """What the issue's targets are about: one host's ranks alone (cross_path: the group
    spans hosts; machine.network: what joins them; args.busy: processes competing for the cores)."""
    return (doc.get("cross_path") is None and not doc.get("machine", {}).get("network")
            and not doc.get("args", {}).get("busy"))


def series_rows(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["series"], []).append(row)
    for rs in out.values():
        rs.sort(key=lambda r: r["size"])
    return out


def baseline_name(doc: dict) -> str | None:
    return next((r["series"] for r in doc.get("rows", []) if r.get("kind") == "baseline"), None)


def speedup_lines(doc: dict) -> list[str]:
    base_name = baseline_name(doc)
    if base_name is None:
        return []
    by = series_rows(doc["rows"])
    base = {r["size"]: r for r in by[base_name]}
    small = min(base)
    lines = []
    for name, rows in by.items():
        if name == base_name or name.startswith("part:"):  # (--series parts: steps, not all-reduces)
            continue
        sp = [r["speedup"] for r in rows if r.get("speedup")]
        if not sp:
            continue
        line = f"{name}: speedup over {base_name} {min(sp):.2f}x..{max(sp):.2f}x"
        big = [r["speedup"] for r in rows if 16 * MiB <= r["size"] <= 256 * MiB and r.get("speedup")]
        if big:
            line += f"; at 16-256 MiB busbw >= {min(big):.2f}x"
        mine = next((r for r in rows if r["size"] == small), None)
        if mine is not None:
            b = base[small]["time_us"]
            line += f"; at {human_bytes(small)} {mine['time_us']:.1f} us vs {b:.1f} us ({b / mine['time_us']:.1f}x)"
        lines.append(line)
    return lines


def targets(doc: dict) -> dict[str, bool]:
    args, rows = doc.get("args", {}), doc.get("rows", [])
    if (args.get("device") != "cpu" or args.get("dtype") != "float32" or baseline_name(doc) != "gloo"
            or len(args.get("algos", [args.get("algo")])) != 1 or not complete(doc) or not single_host(doc)):
        return {}
    by = series_rows(rows)
    t: dict[str, bool] = {}

    def min_big(name):
        big = [r["speedup"] for r in by.get(name, []) if 16 * MiB <= r["size"] <= 256 * MiB]
        return min(big) if big else None

    world = world_of(doc)
    coll = doc.get("collective", "all_reduce")
    if coll != "all_reduce":
        if coll in ("reduce_scatter", "all_gather") and world == 2:
            for name in ("ringdp", "ringdp-reg"):
                m = min_big(name)
                if m is not None:
                    t[f"{name}_16M_256M_ge_4x"] = m >= 4.0
        return t
    if world == 2:
        for name, key, goal in (("ringdp", "ordinary_16M_256M_ge_3.5x", 3.5),
                                ("ringdp-reg", "registered_16M_256M_ge_6x", 6.0)):
            m = min_big(name)
            if m is not None:
                t[key] = m >= goal
        gloo_4k = next((r["time_us"] for r in by["gloo"] if r["size"] == 4096), None)
        four_k = [r for r in rows if r["size"] == 4096 and r["kind"] != "baseline"]
        if gloo_4k is not None and four_k:
            t["latency_4KiB_le_1/8"] = all(r["time_us"] * 8 <= gloo_4k for r in four_k)
    elif world == 4:
        ours = [r for r in rows if r["kind"] != "baseline"]
        if ours:
            t["faster_than_gloo_every_size"] = all((r.get("speedup") or 0) > 1.0 for r in ours)
    return t


def crossovers(runs: list[tuple[str, dict]]) -> list[str]:
    """For each pair of ringdp series of the same kind (ordinary or registered tensors:
    the part of the name before ':'), the sizes at which the faster one changes."""
    curves: dict[str, dict[int, float]] = {}
    kinds: dict[str, str] = {}
    for label, payload in runs:
        for name, rows in series_rows(payload["rows"]).items():
            if name.startswith("ringdp"):
                full = f"{name} ({label})" if label else name
                curves[full] = {r["size"]: r["time_us"] for r in rows}
                kinds[full] = name.split(":", 1)[0]
    lines = []
    names = sorted(curves)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if kinds[a] != kinds[b]:
                continue
            common = sorted(set(curves[a]) & set(curves[b]))
            if not common:
                continue
            winner = [a if curves[a][s] <= curves[b][s] else b for s in common]
            parts = [f"{winner[0]} up to"]
            for k in range(1, len(common)):
                if winner[k] != winner[k - 1]:
                    parts.append(f"{human_bytes(common[k - 1])}, then {winner[k]} from {human_bytes(common[k])} up to")
            parts.append(human_bytes(common[-1]))
            lines.append(f"{a} vs {b}: faster is " + " ".join(parts))
    return lines


def oneshot_suggestion(doc: dict) -> dict | None:
    """{"up_to": {kind: bytes}, "against": {kind: what the forced ring ran}, "suggested":
    bytes, "capped": bool} from the mean times of the forced ring and one-shot series (a
    registered tensor's forced ring runs direct on CPU: its rows' algo); None unless both
    were measured."""
    by = series_rows(doc.get("rows", []))
    up_to, against, capped = {}, {}, False
    for kind in ("ringdp", "ringdp-reg"):
        ring = {r["size"]: r["time_us"] for r in by.get(f"{kind}:ring", [])}
        against[kind] = next((r["algo"] for r in by.get(f"{kind}:ring", []) if r.get("algo") != "oneshot"), "ring")
        one = {r["size"]: r["time_us"] for r in by.get(f"{kind}:oneshot", [])}
        common = sorted(set(ring) & set(one))
        if not common:
            continue
        best = 0
        for z in common:
            if one[z] >= ring[z]:
                break
            best = z
        up_to[kind] = best
        capped = capped or best == common[-1]
    if not up_to:
        return None
    return {"up_to": up_to, "against": {k: against[k] for k in up_to}, "suggested": min(up_to.values()),
            "capped": capped}


def summary_lines(doc: dict) -> list[str]:
    lines = speedup_lines(doc)
    lines += [f"target {k}: {'met' if v else 'NOT met'}" for k, v in targets(doc).items()]
    if any(":" in r["series"] for r in doc.get("rows", [])):
        lines += crossovers([("", doc)])
    s = oneshot_suggestion(doc)
    if s:
        lines.append("one-shot beats the ring at every size up to "
                     + ", ".join(f"{human_bytes(v)} ({k}" + ("" if s["against"][k] == "ring" else
                                                          f": the forced ring runs {s['against'][k]}") + ")"
                                 for k, v in s["up_to"].items())
                     + f"; suggested ONESHOT_MAX_BYTES = {s['suggested']}"
                     + (" (capped by the largest size measured one-shot)" if s["capped"] else ""))
    wrong = doc.get("total_wrong")
    if wrong:
        lines.append(f"#wrong total {wrong}: results are NOT correct")
    return lines
