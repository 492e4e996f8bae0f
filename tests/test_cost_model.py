"""bench/cost_model.py: the alpha-beta formulas against closed forms, the fit on synthetic
data, the schedule of the pipelined two-level algorithm, and the script end to end on the
committed results (no torch needed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import cost_model as cm  # noqa: E402

MiB = 1 << 20


def test_ring_formulas_closed_form():
    a, b = 5e-6, 1e-9
    assert cm.ring_allreduce(1, 1e9, a, b) == 0.0
    assert cm.ring_reduce_scatter(1, 1e9, a, b) == 0.0
    assert cm.ring_allreduce(2, 1000, a, b) == pytest.approx(2 * a + 1000 * b)
    assert cm.ring_allreduce(8, 8000, a, b) == pytest.approx(14 * a + 14000 * b)
    # all-reduce = reduce-scatter + all-gather of the same S
    assert cm.ring_allreduce(5, 12345, a, b) == pytest.approx(
        cm.ring_reduce_scatter(5, 12345, a, b) + cm.ring_all_gather(5, 12345, a, b))


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_alpha_beta(relative):
    import numpy as np

    x = np.array([1, 4, 16, 64, 256], float) * MiB
    alpha, beta = 1.5e-3, 0.8e-9
    f = cm.fit_alpha_beta(x, alpha + beta * x, relative=relative)
    assert f["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert f["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert f["rms_rel_err"] < 1e-9 and f["rows"] == 5
    # noisy data: the fit is close, and its error is reported
    noise = 1 + 0.05 * np.array([1, -1, 1, -1, 1])
    g = cm.fit_alpha_beta(x, (alpha + beta * x) * noise)
    assert g["beta_s_per_byte"] == pytest.approx(beta, rel=0.1)
    assert 0.02 < g["rms_rel_err"] < 0.08
    # alpha given: beta alone
    h = cm.fit_alpha_beta(x, 2e-3 + beta * x, alpha=2e-3)
    assert h["alpha_s"] == 2e-3 and h["beta_s_per_byte"] == pytest.approx(beta)
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([MiB, MiB], [1.0, 2.0])


def _hw(case="nic_per_gpu", G=8, launch=0.0):
    return cm.hw_params(case, G, launch_us=launch)


@pytest.mark.parametrize("case", list(cm.NIC_CASES))
@pytest.mark.parametrize("S", [MiB, 64 * MiB, 1 << 30])
def test_two_level_one_host_is_the_in_host_allreduce(case, S):
    hw = _hw(case)
    want = cm.ring_allreduce(8, S, hw["a_nv"], 1 / hw["b_nv"])
    assert cm.two_level(S, 1, hw) == pytest.approx(want)
    assert cm.flat_ring(S, 1, hw) == pytest.approx(want)
    # every collective pays the launch: RS + AG is one more than one all-reduce
    hw = _hw(case, launch=8.4)
    assert cm.two_level(S, 1, hw) == pytest.approx(cm.flat_ring(S, 1, hw) + 8.4e-6)


@pytest.mark.parametrize("H", [2, 4, 16])
@pytest.mark.parametrize("case", list(cm.NIC_CASES))
def test_two_level_one_gpu_per_host_is_the_flat_inter_host_ring(H, case):
    hw = _hw(case, G=1, launch=8.4)
    S = 256 * MiB
    want = 8.4e-6 + cm.ring_allreduce(H, S, hw["a_net"], 1 / hw["b_nic"])
    assert cm.flat_ring(S, H, hw) == pytest.approx(want)
    assert cm.two_level(S, H, hw) == pytest.approx(want)


def test_flat_ring_closed_form():
    hw = _hw("nic_per_host", launch=8.4)
    H, G, S = 4, 8, 1 << 30
    N = H * G
    lat = 8.4e-6 + (2 * (N - 1) - 2 * (H - 1)) * 3.4e-6 + 2 * (H - 1) * 9.6e-6
    assert cm.flat_ring(S, H, hw) == pytest.approx(lat + 2 * (N - 1) / N * S / 46e9)  # the one NIC bounds it
    hw8 = _hw("nic_per_gpu", launch=8.4)  # 8 x 46 GB/s: NIC-bound at 368 GB/s busbw
    assert cm.flat_ring(S, H, hw8) == pytest.approx(lat + 2 * (N - 1) / N * S / (8 * 46e9))


def test_unpipelined_is_the_sum_and_pipelining_hides_the_smaller_stage():
    hw = _hw("nic_per_host")
    H, S = 2, 1 << 30
    rs = cm.ring_reduce_scatter(8, S, hw["a_nv"], 1 / hw["b_nv"])
    ar = cm.ring_allreduce(H, S / 8, hw["a_net"], 8 / hw["b_nic"])  # 8 local ranks share one NIC
    assert cm.two_level(S, H, hw) == pytest.approx(2 * rs + ar)
    pip = cm.two_level(S, H, hw, 16 * MiB)
    assert ar < pip < 2 * rs + ar  # the network stage bounds it, the in-host work mostly hidden
    # 64 pieces, network bound (rs + ag of a piece < its all-reduce): the first piece's rs,
    # 64 all-reduces back to back (each paying its own 2(H-1) alpha), the last piece's ag
    p = 16 * MiB
    rs_p = cm.ring_reduce_scatter(8, p, hw["a_nv"], 1 / hw["b_nv"])
    ar_p = cm.ring_allreduce(H, p / 8, hw["a_net"], 8 / hw["b_nic"])
    assert 2 * rs_p < ar_p
    assert pip == pytest.approx(rs_p + 64 * ar_p + rs_p)


def test_schedule_closed_forms():
    # in-host stages only: rs and ag of every piece, one after the other
    assert cm.schedule([(1.0, 0.0, 2.0)] * 3) == pytest.approx(9.0)
    # network bound: rs0, then the all-reduces back to back, then the last ag
    assert cm.schedule([(1.0, 10.0, 1.0)] * 4) == pytest.approx(1 + 4 * 10 + 1)
    # one piece: the plain sum
    assert cm.schedule([(1.0, 2.0, 3.0)]) == pytest.approx(6.0)


def test_call_check_closed_forms():
    """The call check: (H-1) gloo steps, beside the first reduce-scatter; the first all-reduce
    waits for it, so it costs only what it outlasts that reduce-scatter by."""
    hw = _hw("nic_per_gpu")
    assert cm.call_check(2, hw) == pytest.approx(55e-6) and cm.call_check(16, hw) == pytest.approx(50e-6 + 15 * 5e-6)
    ring = dict(hw, check_shape="ring")  # (ringdp's check until 2026-12-05: gloo's ring all-gather)
    assert cm.call_check(2, ring) == pytest.approx(50e-6) and cm.call_check(16, ring) == pytest.approx(15 * 50e-6)
    assert cm.call_check(1, hw) == 0.0
    assert cm.schedule([(1.0, 2.0, 3.0)], check=0.5) == pytest.approx(6.0)  # hidden by rs 0
    assert cm.schedule([(1.0, 2.0, 3.0)], check=5.0) == pytest.approx(5 + 2 + 3)
    assert cm.schedule([(1.0, 10.0, 1.0)] * 4, check=3.0) == pytest.approx(3 + 4 * 10 + 1)
    for H, S in ((2, MiB), (16, MiB), (16, 64 * MiB), (4, 1 << 30)):
        rs0 = cm._stages(cm._pieces(S, 16 * MiB)[0], H, hw)[0]
        extra = cm.two_level(S, H, hw, 16 * MiB, check=True) - cm.two_level(S, H, hw, 16 * MiB)
        assert extra == pytest.approx(max(0.0, cm.call_check(H, hw) - rs0), abs=1e-12)


def test_pieces():
    assert cm._pieces(10, None) == [10.0]
    assert cm._pieces(10, 4) == [4.0, 4.0, 2.0]
    assert cm._pieces(8, 4) == [4.0, 4.0]
    assert cm._pieces(3, 4) == [3.0]


def test_link_rate():
    net = lambda s: {"machine": {"network": s}}  # noqa: E731
    assert cm.link_rate_Bps(net("2 hosts in network namespaces, one veth link, 2gbit each way (tc tbf)")) == 2.5e8
    assert cm.link_rate_Bps(net("..., 500mbit each way (tc tbf)")) == 62.5e6
    with pytest.raises(ValueError, match="no shaped link"):
        cm.link_rate_Bps(net("2 hosts in network namespaces, one veth link, unshaped"))


def test_script_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "cost_model.py"), "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "predicted vs measured" in r.stdout and "projection" in r.stdout
    out = json.loads((tmp_path / "cost_model_projection.json").read_text())
    png = (tmp_path / "cost_model_projection.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert set(out["fits"]) == {"gloo2", "shm_rs", "shm_ag", "gloo4_flat"}
    for f in out["fits"].values():
        assert f["alpha_s"] >= 0 and f["beta_s_per_byte"] > 0
    # the committed measurements: the calibrated two-level prediction within 30% from 16 MiB
    assert out["validation_summary"]["two_level_calibrated_max_abs_err"] < 0.3
    # the projection's formulas on the shaped link (LINK_FILE): within 30% from 16 MiB, the
    # two-level path faster than flat gloo there, as predicted
    link = out["link"]
    assert link["rate_Bps"] == 2.5e8 and link["max_abs_err_from_16MiB"] < 0.3
    big = [x for x in link["rows"] if x["size"] >= 16 * MiB]
    assert len(big) >= 3 and all(x["speedup_measured"] > 1.2 and x["speedup_pred"] > 1.2 for x in big)
    assert "shaped link" in r.stdout
    sizes = {r["size"] for r in out["validation"]}
    assert {16 * MiB, 64 * MiB, 256 * MiB} <= sizes
    grid = out["grid"]
    assert len(grid) == 2 * 4 * 11
    for g in grid:
        assert g["flat_us"] > 0 and g["two_level_us"] > 0
        assert g["speedup"] == pytest.approx(g["flat_us"] / g["two_level_us"])
        assert g["two_level_checked_us"] >= g["two_level_us"] and g["check_us"] == pytest.approx(50 + (g["hosts"] - 1) * 5)
        assert g["two_level_best_piece_us"] <= min(g["two_level_us"], g["two_level_unpipelined_us"]) + 1e-9
    # one NIC per host, 2 hosts, 1 GiB: the hierarchy's bound (1 - 1/N) / (1 - 1/H) = 1.875
    g = next(x for x in grid if x["nic_case"] == "nic_per_host" and x["hosts"] == 2 and x["size"] == 1 << 30)
    assert 1.5 < g["speedup_best_piece"] < 1.875
    assert out["assumptions"]["nic_GBps"] == 46.0
    # the solid line is ringdp's policy: pieces of policy.two_level_piece_bytes
    for g in grid:
        p = cm.policy.two_level_piece_bytes(g["size"], cm.policy.HIER_PIECE_BYTES)
        assert g["piece_bytes"] == min(p, g["size"]) and g["pieces"] == -(-g["size"] // p)
        assert g["pieces"] <= cm.policy.HIER_MAX_PIECES
    # the check's sensitivity: slower steps of the check, never a faster call; at 16 hosts and
    # 1 MiB a 200 us step makes the two levels lose to the flat ring
    sens = out["check_sensitivity"]
    assert {r["alpha_check_us"] for r in sens} == {20.0, 50.0, 200.0}
    cell = lambda c: (c["nic_case"], c["hosts"], c["size"])  # noqa: E731
    for c in sens:
        same = sorted((x for x in sens if cell(x) == cell(c) and x["check_shape"] == c["check_shape"]),
                      key=lambda x: x["alpha_check_us"])
        assert [x["speedup_checked"] for x in same] == sorted((x["speedup_checked"] for x in same), reverse=True)
        assert c["speedup_checked"] <= c["speedup"] + 1e-12
        if c["check_shape"] == "alltoall" and c["hosts"] > 2:  # one step: faster than the ring's H-1
            ring = next(x for x in sens if cell(x) == cell(c) and x["check_shape"] == "ring"
                        and x["alpha_check_us"] == c["alpha_check_us"])
            assert c["speedup_checked"] >= ring["speedup_checked"] - 1e-12 and c["check_us"] < ring["check_us"]
    # 16 hosts, 1 MiB, 200 us a step: the ring check made the two levels lose to the flat ring
    assert next(c for c in sens if cell(c) + (c["alpha_check_us"], c["check_shape"])
                == ("nic_per_gpu", 16, MiB, 200.0, "ring"))["speedup_checked"] < 1
    assert "with the call check" in r.stdout
    rules = {r["max_pieces"]: r for r in out["piece_rules"]}
    assert rules[cm.policy.HIER_MAX_PIECES]["is_ringdp_default"]
    for r in out["piece_rules"]:
        assert r["cells"] == 2 * 15 * 11 and r["geomean_vs_best"] >= 1 - 1e-12 and r["worst_vs_best"] >= 1 - 1e-12


def _load_real_policy():
    """ringdp/policy.py as the package has it (without importing torch through ringdp)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_policy_check", ROOT / "ringdp" / "policy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_uses_ringdps_policy():
    pol = _load_real_policy()
    assert Path(cm.policy.__file__).resolve() == (ROOT / "ringdp" / "policy.py").resolve()
    assert cm.policy.__name__ == "_ringdp_policy"  # loaded by path, not through the package (torch)
    assert cm.DEFAULTS["min_piece_bytes"] == pol.HIER_PIECE_BYTES
    assert cm.DEFAULTS["max_pieces"] == pol.HIER_MAX_PIECES
    args = cm.parse_args([])
    hw = cm.hw_params("nic_per_gpu")
    for S in cm.DEFAULTS["sizes"]:
        p = pol.two_level_piece_bytes(S, pol.HIER_PIECE_BYTES)
        assert cm.ringdp_piece(S, args) == p
        assert cm.two_level(S, 4, hw, cm.ringdp_piece(S, args)) == cm.two_level(S, 4, hw, p)
    # closed forms of the pieces the model schedules: one up to the minimum, then HIER_MAX_PIECES
    k = pol.HIER_MAX_PIECES
    assert cm._pieces(MiB, cm.ringdp_piece(MiB, args)) == [float(MiB)]
    assert cm._pieces(16 * MiB, cm.ringdp_piece(16 * MiB, args)) == [16.0 * MiB]
    assert cm._pieces(1 << 30, cm.ringdp_piece(1 << 30, args)) == [float((1 << 30) // k)] * k


def test_piece_rule_is_near_the_models_best():
    """HIER_MAX_PIECES is the count whose rule comes closest to the model's best piece (what
    policy.py's comment says): the best geometric mean of the rules compared, and far better
    than fixed 16 MiB pieces at large sizes across many hosts."""
    args = cm.parse_args([])
    rules = cm.compare_piece_rules(args, hosts=[2, 4, 8, 16])
    ours = next(r for r in rules if r["is_ringdp_default"])
    assert ours["geomean_vs_best"] == min(r["geomean_vs_best"] for r in rules)
    fixed = next(r for r in rules if r["max_pieces"] is None)
    assert ours["worst_vs_best"] < 1.35 < 2.5 < fixed["worst_vs_best"]
    assert fixed["geomean_vs_best"] > ours["geomean_vs_best"] + 0.1
    hw = cm.hw_params("nic_per_gpu")
    S = 1 << 30
    assert cm.flat_ring(S, 16, hw) / cm.two_level(S, 16, hw, cm.ringdp_piece(S, args)) > 0.75
    assert cm.flat_ring(S, 16, hw) / cm.two_level(S, 16, hw, 16 * MiB) < 0.3


def test_validation_uses_the_pieces_the_file_was_measured_with():
    old = cm.measured_pieces({"env": {}})
    assert old(256 * MiB) == 16 * MiB  # files before policy.two_level_piece_bytes: fixed 16 MiB
    assert cm.measured_pieces({"env": {"RINGDP_HIER_PIECE_BYTES": str(1 << 40)}})(256 * MiB) == 1 << 40
    new = cm.measured_pieces({"hier_pieces": {"min_piece_bytes": 16 * MiB, "max_pieces": 2}})
    assert new(256 * MiB) == 128 * MiB and new(16 * MiB) == 16 * MiB and new(20 * MiB) == 16 * MiB


def test_every_hosts2_run_is_validated_with_the_same_fits(tmp_path):
    """validate_runs: one row per committed --hosts 2 all-reduce run of 2 hosts x 2 ranks
    (other layouts, and a run of small sizes alone, left out); a run whose two-level times are the nominal model's own
    predictions comes out with no error, one twice as slow at -50%."""
    import shutil

    for name in {c[0] for c in cm.COMPONENTS.values()}:
        shutil.copy(cm.ROOT / "bench" / "results" / name, tmp_path / name)
    fits, docs = cm.fit_components(tmp_path)
    base = docs[cm.COMPONENTS["gloo4_flat"][0]]
    piece_of = cm.measured_pieces(base)

    def run(scale: float, hosts: list[str]) -> dict:
        rows = []
        for S in (MiB, 16 * MiB, 64 * MiB, 256 * MiB):
            tl = cm.box_two_level(S, fits, 2.0, 2.0, piece_of(S))["total_s"]
            rows += [{"size": S, "series": "ringdp", "time_us": scale * tl * 1e6},
                     {"size": S, "series": "gloo", "time_us": cm.box_flat_gloo(S, fits, 2.0) * 1e6}]
        return dict(base, hosts=hosts, rows=rows)

    (tmp_path / "allreduce_cpu_w4_float32_exact_hosts2.json").write_text(json.dumps(run(1.0, ["a", "a", "b", "b"])))
    (tmp_path / "allreduce_cpu_w4_float32_slow_hosts2.json").write_text(json.dumps(run(2.0, ["a", "a", "b", "b"])))
    (tmp_path / "allreduce_cpu_w4_float32_uneven_hosts2.json").write_text(json.dumps(run(1.0, ["a", "a", "a", "b"])))
    small = run(1.0, ["a", "a", "b", "b"])  # a sweep below 16 MiB alone: nothing to validate
    small["rows"] = [r for r in small["rows"] if r["size"] < 16 * MiB]
    (tmp_path / "allreduce_cpu_w4_float32_small_hosts2.json").write_text(json.dumps(small))
    got = {v["file"]: v for v in cm.validate_runs(tmp_path, fits, docs)}
    assert set(got) == {"allreduce_cpu_w4_float32_hosts2.json", "allreduce_cpu_w4_float32_exact_hosts2.json",
                        "allreduce_cpu_w4_float32_slow_hosts2.json"}
    assert [v["fitted"] for v in got.values()].count(True) == 1 and got["allreduce_cpu_w4_float32_hosts2.json"]["fitted"]
    assert got["allreduce_cpu_w4_float32_exact_hosts2.json"]["two_level_nominal_max_abs_err"] == pytest.approx(0, abs=1e-9)
    assert got["allreduce_cpu_w4_float32_exact_hosts2.json"]["flat_gloo_nominal_max_abs_err"] == pytest.approx(0, abs=1e-9)
    assert got["allreduce_cpu_w4_float32_slow_hosts2.json"]["two_level_nominal_max_abs_err"] == pytest.approx(0.5)
    # the fitted run's row is the main validation's
    main = cm.validation_summary(cm.validate(base, fits, cm.contention_factors(fits, docs)))
    for k, x in main.items():
        assert got["allreduce_cpu_w4_float32_hosts2.json"][k] == pytest.approx(x)


def test_the_committed_hosts2_runs_are_within_what_docs_say():
    """docs/hierarchy.md "Across runs": the two-level time of every committed --hosts 2 run
    predicted within 30% by the nominal model and within 45% calibrated; where the run timed
    its steps alone (--series parts), within 25% with the factors read off them."""
    out = cm.run(cm.parse_args([]))
    runs = out["validation_runs"]
    assert len(runs) >= 6 and sum(v["fitted"] for v in runs) == 1
    for v in runs:
        assert v["two_level_nominal_max_abs_err"] < 0.3 and v["two_level_calibrated_max_abs_err"] < 0.45, v
    steps = [v for v in runs if v["contention_steps"] is not None]
    assert steps and all(v["two_level_steps_max_abs_err"] < 0.25 for v in steps), steps


def test_steps_factors_are_the_runs_own_steps_over_the_fits():
    """steps_factors: a run whose part:inhost and part:cross times are k times the 2-rank
    fits (shm RS + AG at S, gloo at S/2) from 16 MiB gives exactly k, the median over those
    sizes (a wild row below 16 MiB and one odd size do not move it); a run without them, None;
    and the two-level prediction with them is the sum of the steps, piece by piece."""
    fits, docs = cm.fit_components(cm.ROOT / "bench" / "results")
    base = docs[cm.COMPONENTS["gloo4_flat"][0]]
    assert cm.steps_factors(base, fits) is None

    def rows(k_shm, k_gloo, sizes):
        out = []
        for S in sizes:
            shm = cm.predict(fits["shm_rs"], S) + cm.predict(fits["shm_ag"], S)
            out += [{"size": S, "series": "part:inhost", "time_us": k_shm * shm * 1e6},
                    {"size": S, "series": "part:cross", "time_us": k_gloo * cm.predict(fits["gloo2"], S / 2) * 1e6}]
        return out

    run = dict(base, rows=base["rows"] + rows(3.0, 1.5, (16 * MiB, 64 * MiB)) + rows(9.0, 9.0, (MiB,))
               + rows(5.0, 0.5, (256 * MiB,)) + rows(3.0, 1.5, (128 * MiB,)))
    got = cm.steps_factors(run, fits)
    assert got["shm"] == pytest.approx(3.0) and got["gloo"] == pytest.approx(1.5)
    S = 16 * MiB  # one piece: the prediction is the two steps' sum and the call check
    tl = cm.box_two_level(S, fits, got["shm"], got["gloo"], cm.measured_pieces(base)(S))
    step_rows = {r["series"]: r["time_us"] * 1e-6 for r in run["rows"] if r["size"] == S and "part" in r["series"]}
    assert tl["check_s"] == pytest.approx(got["gloo"] * fits["gloo2"]["alpha_s"])  # one gloo round trip
    assert tl["total_s"] == pytest.approx(sum(step_rows.values()) + tl["check_s"])
