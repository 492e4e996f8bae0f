#!/usr/bin/env bash
# Everything ringdp wants to know from a GPU machine, in one go:
#   1. facts (nvidia-smi, torch, nvcc, NCCL), 2. build ringdp with CUDA, 3. the nvcc compile
#   check, 4. device-to-device copy bandwidth, 5. GPU tests without MPS (ranks time-sliced),
#   6. with MPS if nvidia-cuda-mps-control exists (started here, stopped on exit): a test
#   subset with truly concurrent ranks and the benchmarks, 7. bench/allreduce.py --device cuda
#   for the ipc and nccl transports, world 2 and 4 on this GPU (torch.distributed baseline
#   where it can run), 8. summary.json: copy bandwidth, efficiency of the IPC ring at
#   >= 64 MiB (bytes read+written in device memory by all ranks / time / copy bandwidth;
#   target >= 70%), latency at 8 KiB, #wrong, test results.
#
#   bash bench/gpu_check.sh OUT_DIR            # logs and JSON land in OUT_DIR
#   GPU_CHECK_QUICK=1 bash bench/gpu_check.sh OUT_DIR   # smaller sweep, fewer tests
#
# Needs: a CUDA build of torch, nvcc, and the build tools (ninja, pybind11) already
# installed: the machine may have no network. Every step is logged and timed; a failing step
# does not stop the later ones (the summary says which failed). Exit status: 0 when every
# step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
OUT="${1:-$ROOT/bench/results/gpu_check_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
QUICK="${GPU_CHECK_QUICK:-0}"
PY="${PYTHON:-python}"
STEPS="$OUT/steps.tsv"
: > "$STEPS"
FAILED=0

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }
step() {  # step NAME TIMEOUT_S CMD... : run, log to OUT/NAME.log, record status and time
  local name="$1" limit="$2"; shift 2
  log "step $name: $*"
  local t0=$(date +%s) rc
  timeout --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\n' "$name" "$rc" "$dt" >> "$STEPS"
  if [ "$rc" -eq 0 ]; then log "step $name: ok (${dt}s)"; else log "step $name: FAILED rc=$rc (${dt}s), see $OUT/$name.log"; FAILED=1; fi
  tail -n 5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu_check.log"
  return $rc
}

# ---------------------------------------------------------------------------- 1. facts
log "output: $OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1 || true
(command -v nvcc && nvcc --version) > "$OUT/nvcc.txt" 2>&1 || true
"$PY" - > "$OUT/env.json" 2>"$OUT/env.err" <<'EOF'
import json, os, platform, socket
import torch
info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cpu_cores": os.cpu_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                memory_GiB=round(p.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
try:
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as e:
    info["nccl"] = f"unavailable: {e}"
print(json.dumps(info, indent=1))
EOF
cat "$OUT/env.json" | tee -a "$OUT/gpu_check.log"
CAP="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("capability",""))' "$OUT/env.json" 2>/dev/null)"
GPU_NAME="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("gpu","unknown"))' "$OUT/env.json" 2>/dev/null)"
if [ -z "$CAP" ]; then
  log "no CUDA device visible to torch: nothing to check"
  exit 1
fi

# ---------------------------------------------------------------------------- 2. build
export RINGDP_BUILD_CUDA=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$CAP}"
export MAX_JOBS="${MAX_JOBS:-8}"
step build 1800 "$PY" -m pip install --no-build-isolation --no-deps -v -e . || true
step build_info 120 "$PY" -c "import ringdp, json; print(json.dumps(ringdp.build_info()))" || true

# ---------------------------------------------------------------------------- 3. nvcc check
step compile_cuda 900 bash .ci/compile_cuda.sh || true

# ---------------------------------------------------------------------------- 4. copy bandwidth
step copy_bw 300 "$PY" - "$OUT/copy_bw.json" <<'EOF'
import json, sys
import torch
n = 1 << 30  # 1 GiB each way
src = torch.ones(n // 4, device="cuda")
dst = torch.empty_like(src)
res = {}
for name, fn in (("copy_", lambda: dst.copy_(src)), ("add_", lambda: dst.add_(src))):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    streams = 2 if name == "copy_" else 3  # bytes moved: copy reads+writes, add reads 2 writes 1
    best = min(times)
    res[name] = {"bytes_per_call": streams * n, "best_s": best, "GBps": streams * n / best / 1e9,
                 "median_GBps": streams * n / sorted(times)[len(times) // 2] / 1e9}
res["copy_GBps"] = res["copy_"]["GBps"]
res["counts"] = "bytes read + bytes written per second"
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res, indent=1))
EOF

# ---------------------------------------------------------------------------- 5. tests, no MPS
PYTEST_ARGS=(-q -rs -p no:cacheprovider)
if [ "$QUICK" = "1" ]; then
  step tests_cuda 3600 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/test_cuda.py -k "world2 or not matrix" \
    --junitxml="$OUT/tests_cuda.xml" || true
else
  step tests_cuda 5400 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/test_cuda.py --junitxml="$OUT/tests_cuda.xml" || true
fi
# The CPU suite too (it must not have been broken by a CUDA build).
step tests_cpu 3600 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests --ignore=tests/test_cuda.py \
  --junitxml="$OUT/tests_cpu.xml" || true

# ---------------------------------------------------------------------------- 6. MPS
MPS=0
MPS_USED=0
stop_mps() {
  if [ "$MPS" = "1" ]; then
    echo quit | nvidia-cuda-mps-control > /dev/null 2>&1 || true
    sleep 2
    MPS=0
    log "MPS stopped"
  fi
}
trap stop_mps EXIT
if command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d > "$OUT/mps_start.log" 2>&1; then
    sleep 2
    if "$PY" -c "import torch; torch.ones(1, device='cuda'); print('MPS client ok')" >> "$OUT/mps_start.log" 2>&1; then
      MPS=1
      MPS_USED=1
      log "MPS started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    else
      log "MPS daemon started but a client could not connect: stopping it, benchmarks run time-sliced"
      echo quit | nvidia-cuda-mps-control > /dev/null 2>&1 || true
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  else
    log "nvidia-cuda-mps-control -d failed (see mps_start.log): benchmarks run time-sliced"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
else
  log "nvidia-cuda-mps-control not found: benchmarks run time-sliced (slow, not representative)"
fi
if [ "$MPS" = "1" ]; then
  # Concurrent ranks exercise interleavings time-slicing never produces.
  step tests_cuda_mps 3600 "$PY" -m pytest "${PYTEST_ARGS[@]}" tests/test_cuda.py \
    -k "matrix or registered or stream_ordering or mismatch" --junitxml="$OUT/tests_cuda_mps.xml" || true
fi

# ---------------------------------------------------------------------------- 7. benchmarks
BENCH_DIR="$OUT/bench"
mkdir -p "$BENCH_DIR"
if [ "$QUICK" = "1" ]; then SWEEP=(-b 8K -e 128M -f 4); else SWEEP=(-b 8K -e 256M -f 2); fi
for world in 2 4; do
  for transport in ipc nccl; do
    envs=(RINGDP_TRANSPORT=$transport)
    # Ranks of one GPU must look like separate hosts to NCCL (sockets between them).
    [ "$transport" = nccl ] && envs+=(RINGDP_NCCL_HOSTID_PER_RANK=1)
    step "bench_${transport}_w${world}" 3600 env "${envs[@]}" "$PY" bench/allreduce.py --device cuda --world "$world" \
      "${SWEEP[@]}" --no-baseline --series ringdp,ringdp-reg --algo auto --out-dir "$BENCH_DIR" \
      --name "$transport" || true
  done
  # torch.distributed baseline: NCCL refuses two ranks on one GPU unless NCCL >= 2.30 allows
  # it; else gloo (host staging) so there is a figure at all.
  if ! step "bench_baseline_nccl_w${world}" 3600 env NCCL_MULTI_RANK_GPU_ENABLE=1 "$PY" bench/allreduce.py \
      --device cuda --world "$world" "${SWEEP[@]}" --series baseline --baseline nccl --out-dir "$BENCH_DIR" \
      --name baseline_nccl; then
    step "bench_baseline_gloo_w${world}" 3600 "$PY" bench/allreduce.py --device cuda --world "$world" \
      -b 8K -e 64M -f 4 --series baseline --baseline gloo --out-dir "$BENCH_DIR" --name baseline_gloo || true
  fi
done
# Small-message thresholds: ring vs one-shot on IPC.
step bench_ipc_algos_w2 1800 env RINGDP_TRANSPORT=ipc "$PY" bench/allreduce.py --device cuda --world 2 \
  -b 1K -e 4M -f 2 --no-baseline --series ringdp --algo ring,oneshot --out-dir "$BENCH_DIR" --name ipc_algos || true
stop_mps

# ---------------------------------------------------------------------------- 8. summary
"$PY" - "$OUT" "$MPS_USED" <<'EOF' | tee -a "$OUT/gpu_check.log"
import glob, json, os, sys
out = sys.argv[1]
summary = {"gpu_check": out}
try:
    summary["env"] = json.load(open(os.path.join(out, "env.json")))
except Exception as e:
    summary["env"] = f"unreadable: {e}"
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, dt = line.rstrip("\n").split("\t")
    steps.append({"step": name, "rc": int(rc), "seconds": int(dt)})
summary["steps"] = steps
summary["failed_steps"] = [s["step"] for s in steps if s["rc"] != 0]
copy = None
try:
    cb = json.load(open(os.path.join(out, "copy_bw.json")))
    copy = cb["copy_GBps"]
    summary["copy_bandwidth_GBps"] = copy
    summary["add_bandwidth_GBps"] = cb["add_"]["GBps"]
except Exception as e:
    summary["copy_bandwidth_GBps"] = f"unmeasured: {e}"
# junit results
import xml.etree.ElementTree as ET
for x in sorted(glob.glob(os.path.join(out, "tests_*.xml"))):
    try:
        r = ET.parse(x).getroot()
        s = r if r.tag == "testsuite" else r.find("testsuite")
        summary[os.path.basename(x)[:-4]] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except Exception as e:
        summary[os.path.basename(x)[:-4]] = f"unreadable: {e}"
bench = {}
for f in sorted(glob.glob(os.path.join(out, "bench", "*.json"))):
    d = json.load(open(f))
    world = d.get("machine", {}).get("world_size")
    key = os.path.basename(f)[:-5]
    entry = {"file": f, "world": world, "total_wrong": d.get("total_wrong")}
    by_series = {}
    for r in d.get("rows", []):
        by_series.setdefault(r["series"], []).append(r)
    for s, rows in by_series.items():
        e = {}
        lat = [r for r in rows if r["size"] == 8192]
        if lat:
            e["latency_8KiB_us"] = lat[0]["time_us"]
        big = [r for r in rows if r["size"] >= (64 << 20)]
        if big and copy and world:
            # all ranks' bytes read+written in device memory per second / copy bandwidth
            eff = [r["bytes_per_rank"] * world / (r["time_us"] * 1e-6) / (copy * 1e9) for r in big]
            e["efficiency_ge_64MiB"] = {"min": min(eff), "max": max(eff),
                                        "by_size": {str(r["size"]): round(v, 3) for r, v in zip(big, eff)}}
            if s.startswith("ringdp") and "ipc" in key:
                e["target_70pct_met"] = min(eff) >= 0.70
        e["busbw_GBps_max"] = max(r["busbw_GBps"] for r in rows)
        by_series[s] = e
    entry["series"] = by_series
    bench[key] = entry
summary["bench"] = bench
summary["mps_used_for_benchmarks"] = sys.argv[2] == "1"
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "bench"}, indent=1))
for k, v in bench.items():
    for s, e in v["series"].items():
        print(f"{k:40s} {s:22s} {json.dumps(e)[:160]}")
EOF
log "summary: $OUT/summary.json  (copy $OUT/bench/*.json to bench/results/gpu_${GPU_NAME// /_}/ to commit)"
exit $FAILED
