#!/usr/bin/env bash
# What ringdp wants to know from a GPU machine, in phases that each fit one command of the
# GPU machine we test on (10 minutes per command, 15 minutes of GPU time in all, the
# machine's start included, at most 8 files brought back, no network, build outputs kept
# only while the machine stays up, which is 30 s after a call):
#
#   bash bench/gpu_check.sh session OUT one device call for a 15-minute lease (~9.5 minutes,
#                                       run with timeout_s 590): build (120 s), priority
#                                       (270 s), bench (150 s), each as below, one after the
#                                       other on this machine; stops after build if ringdp
#                                       has no CUDA (exit 3); 6 files in OUT
#   bash bench/gpu_check.sh build OUT   facts (nvidia-smi, torch, nvcc, NCCL); build ringdp
#                                       with CUDA in place; stop at once (exit 3) unless
#                                       ringdp.build_info()["cuda"] is True
#   bash bench/gpu_check.sh priority OUT  the tests a short lease runs, most wanted first
#                                       (the phase budget skips the rest): the core paths
#                                       whose code changed since the first GPU run (IPC
#                                       matrix, Work, RingDDP, NCCL), then tests that never
#                                       ran on a GPU (the halves, the backend on CUDA, two
#                                       simulated hosts); world 2 and the 4-rank hosts,
#                                       time-sliced
#   bash bench/gpu_check.sh smoke OUT   world-2 correctness of the IPC transport
#                                       (tests/test_cuda.py, ranks time-sliced, no MPS):
#                                       all_reduce, the halves and broadcast (ring and
#                                       one-shot), mismatches, streams, Work, RingDDP
#   bash bench/gpu_check.sh nccl OUT    IPC memory released and a killed peer; world-2
#                                       correctness of the NCCL transport, and the
#                                       torch.distributed backend on CUDA (cuda:ringdp)
#   bash bench/gpu_check.sh hosts OUT   two simulated hosts (a,a,b,b) on the GPU: the CUDA
#                                       all-reduce in two levels (IPC in the host, NCCL
#                                       between hosts) and flat, RingDDP across them, a
#                                       mismatch, a host SIGKILLed; bench/allreduce.py
#                                       --device cuda --hosts 2 (a first figure)
#   bash bench/gpu_check.sh mps OUT     MPS started (pipe/log under /tmp, after quitting a
#                                       daemon a killed run left): world 2-4 tests with
#                                       truly concurrent ranks; MPS quit on every exit path
#   bash bench/gpu_check.sh bench OUT   device copy bandwidth, then bench/allreduce.py
#                                       --device cuda for the ipc and nccl transports, world
#                                       2 and 4 (under MPS when it starts)
#   bash bench/gpu_check.sh probe OUT   bench/cuda_probe.py at world 2 under MPS for
#                                       RINGDP_CUDA_CHANNELS auto, 32, 16, 8, 4: small-call
#                                       latency, RingDDP's step against no communication
#   bash bench/gpu_check.sh cpu OUT     no GPU needed: the CPU targets of issues 11 and 12 on
#                                       this machine's 16 cores (the development box has 2
#                                       for 2-4 ranks): two simulated hosts x 2 ranks against
#                                       flat gloo, stock DDP and FSDP2 on cpu:ringdp against
#                                       gloo; builds the CPU extension itself if no build
#                                       phase ran; ~1.5 min: run it right after session
#                                       (the machine goes back 30 s after a call) with
#                                       the lease's remaining time as its limit
#
# Run build first; the others need its in-place build, so call the phases back to back on
# the same machine while it is up (a build cut short by its timeout resumes where it was:
# run build again). Each phase runs under its own `timeout` (GPU_CHECK_BUDGET_S; default
# build 360 s, priority 270 s, smoke 300 s, nccl 300 s, hosts 560 s, mps 300 s, bench 420 s, probe 240 s,
# cpu 180 s;
# steps get at most what is left; `session` sets its own) and writes exactly two files into OUT:
#   OUT/PHASE.json    steps (name, command, exit code, seconds, status), key figures
#   OUT/PHASE.tar.gz  every log of the phase (test output, junit XML, benchmark JSON)
# Exit status: 0 when every step passed, 3 when ringdp has no CUDA (build), 1 otherwise.
# PYTHON (default python3) picks the interpreter. RINGDP_REQUIRE_CUDA=1 is exported, so a
# CUDA test that would be skipped fails instead.
set -uo pipefail

PHASE="${1:-}"
OUT_ARG="${2:-}"
PHASES="session build priority smoke nccl hosts mps bench probe cpu"
usage() { echo "usage: bash bench/gpu_check.sh {session|build|priority|smoke|nccl|hosts|mps|bench|probe|cpu} OUT_DIR" >&2; exit 2; }
[ -n "$PHASE" ] && [ -n "$OUT_ARG" ] || usage
case " $PHASES " in *" $PHASE "*) ;; *) usage ;; esac

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
mkdir -p "$OUT_ARG" || exit 2
OUT="$(cd "$OUT_ARG" && pwd)"
PY="${PYTHON:-python3}"
# ------------------------------------------------------------------ session
# A 15-minute lease: the machine's start takes 1-2 minutes of it and no machine starts with
# less than 4 left, so everything goes in one call, build, tests and figures on the same
# machine; the budgets (build 58 s and tests ~13 s each on the first H100) leave a minute.
if [ "$PHASE" = session ]; then
  GPU_CHECK_BUDGET_S=120 bash "$0" build "$OUT"
  RC=$?
  if [ "$RC" -ne 0 ] && [ "$RC" -ne 1 ]; then  # 3: no CUDA build (nothing else can run); 2: usage
    echo "gpu_check session: build ended with $RC: stopping" >&2
    exit "$RC"
  fi
  GPU_CHECK_BUDGET_S=270 bash "$0" priority "$OUT" || RC=1
  GPU_CHECK_BUDGET_S=150 bash "$0" bench "$OUT" || RC=1
  exit "$RC"
fi
case "$PHASE" in build) DEFAULT_BUDGET=360 ;; priority) DEFAULT_BUDGET=270 ;; bench) DEFAULT_BUDGET=420 ;; probe) DEFAULT_BUDGET=240 ;; cpu) DEFAULT_BUDGET=180 ;; hosts) DEFAULT_BUDGET=560 ;; *) DEFAULT_BUDGET=300 ;; esac
BUDGET="${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET}"
WORK="${TMPDIR:-/tmp}/ringdp-gpu-check/$PHASE"
MPS_DIR="/tmp/ringdp-mps"
export RINGDP_REQUIRE_CUDA=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# ------------------------------------------------------------------ the phase, outside
# The outer call runs the phase under `timeout`, then writes PHASE.json and PHASE.tar.gz
# whatever happened inside (a killed phase leaves its steps.tsv; MPS is quit again).
if [ -z "${GPU_CHECK_INNER:-}" ]; then
  rm -rf "$WORK" && mkdir -p "$WORK" || exit 2
  rm -f "$OUT/$PHASE.json" "$OUT/$PHASE.tar.gz"
  T0=$(date +%s)
  GPU_CHECK_INNER=1 GPU_CHECK_DEADLINE=$(( T0 + BUDGET - 25 )) \
    timeout --kill-after=10 "$BUDGET" bash "$0" "$PHASE" "$OUT" > "$WORK/phase.log" 2>&1
  RC=$?
  [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ] && echo "phase killed by its timeout (${BUDGET}s)" >> "$WORK/phase.log"
  # a step still running when the phase was killed: end its process group (its own id)
  if [ -s "$WORK/current.pgid" ]; then kill -KILL -- "-$(cat "$WORK/current.pgid")" 2>/dev/null; fi
  if [ "$PHASE" = mps ] || [ "$PHASE" = bench ] || [ "$PHASE" = probe ]; then  # the inner quit it, unless killed
    CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" timeout 10 nvidia-cuda-mps-control <<< quit > /dev/null 2>&1 || true
  fi
  # the summary needs the standard library only: python3 even when PYTHON is something else
  timeout 60 "$(command -v python3 || echo "$PY")" "$ROOT/bench/gpu_check_summary.py" "$PHASE" "$WORK" \
    "$OUT/$PHASE.json" "$RC" "$(( $(date +%s) - T0 ))" >> "$WORK/phase.log" 2>&1 || printf '{"phase": "%s", "exit_code": %s, "error": "summary script failed, see %s.tar.gz"}\n' \
    "$PHASE" "$RC" "$PHASE" > "$OUT/$PHASE.json"
  # logs over 4 MiB keep their last 4 MiB (a file brought back is at most 16 MiB)
  find "$WORK" -type f -size +4M -exec sh -c 'tail -c 4194304 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
  tar -czf "$OUT/$PHASE.tar.gz" -C "$(dirname "$WORK")" "$PHASE"
  tail -n 25 "$WORK/phase.log"
  exit "$RC"
fi

# ------------------------------------------------------------------ inside: steps
STEPS="$WORK/steps.tsv"
: > "$STEPS"
FAILED=0
BUDGET_SKIP_FAILS=1  # a step the phase budget skips fails the phase (priority: not)
log() { echo "[gpu_check $PHASE $(date +%H:%M:%S)] $*"; }
left() { echo $(( GPU_CHECK_DEADLINE - $(date +%s) )); }

# step NAME LIMIT_S CMD...: run with stdout+stderr in WORK/NAME.log, under `timeout` (which
# signals its whole process group, spawned ranks included), with at most the time left.
step() {
  local name="$1" limit="$2"; shift 2
  local have; have=$(left)
  [ "$have" -lt "$limit" ] && limit=$have
  if [ "$limit" -lt 10 ]; then
    log "step $name: skipped (phase budget spent)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "-1" "0" "skipped" "$*" >> "$STEPS"
    [ "$BUDGET_SKIP_FAILS" = 1 ] && FAILED=1
    return 1
  fi
  log "step $name (limit ${limit}s): $*"
  local t0 rc status pid
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$WORK/current.pgid"  # timeout leads its own process group
  printf '%s\t%s\t%s\n' "$name" "$t0" "$*" > "$WORK/current.step"  # for the summary, if killed
  wait "$pid"
  rc=$?
  : > "$WORK/current.pgid"
  : > "$WORK/current.step"
  case "$rc" in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$status" "$*" >> "$STEPS"
  log "step $name: $status rc=$rc ($(( $(date +%s) - t0 ))s)"
  tail -n 4 "$WORK/$name.log" | sed 's/^/    /'
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

need_cuda_build() {  # every phase after build: the in-place CUDA build must be there
  step cuda_build_present 60 "$PY" -c 'import ringdp, sys; i = ringdp.build_info(); print(i); sys.exit(0 if i.get("cuda") else 3)' \
    || { log "ringdp has no CUDA build here: run 'bash bench/gpu_check.sh build OUT' first on this machine"; exit 3; }
}

# pytest on explicit test ids (pytest --collect-only -q tests/test_cuda.py lists them),
# one step per id so that a hang costs one test, not the phase.
cuda_test() {  # cuda_test LIMIT_S TEST_ID
  local limit="$1" id="$2" name
  name="test_$(echo "$id" | sed 's/^test_//; s/[^A-Za-z0-9]\+/_/g; s/_$//')"
  step "$name" "$limit" "$PY" -m pytest -q -rA -p no:cacheprovider "tests/test_cuda.py::$id" \
    --junitxml="$WORK/$name.xml" || true
}

on_term() {  # the phase's timeout: end the running step (its process group), then exit
  if [ -s "$WORK/current.pgid" ]; then kill -TERM -- "-$(cat "$WORK/current.pgid")" 2>/dev/null; fi
  exit 143
}
trap on_term TERM INT

mps_quit() {
  command -v nvidia-cuda-mps-control > /dev/null 2>&1 || return 0
  CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" timeout 10 nvidia-cuda-mps-control <<< quit > /dev/null 2>&1 || return 0
  local i
  for i in 1 2 3 4 5 6 7 8 9 10; do  # the daemon is gone once it no longer answers
    CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" timeout 2 nvidia-cuda-mps-control <<< get_server_list \
      > /dev/null 2>&1 || return 0
    sleep 1
  done
}

mps_start() {  # sets MPS=1 when clients can connect; MPS=0 otherwise (ranks time-sliced)
  MPS=0
  local failed_before=$FAILED
  if ! command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
    log "nvidia-cuda-mps-control not found: ranks run time-sliced"
    return 0
  fi
  mps_quit  # a daemon left by a killed run of this script
  CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps timeout 10 nvidia-cuda-mps-control <<< quit > /dev/null 2>&1 || true  # default dir
  trap mps_quit EXIT
  rm -rf "$MPS_DIR" && mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  if step mps_daemon 30 nvidia-cuda-mps-control -d && sleep 2 &&
      step mps_client 60 "$PY" -c 'import torch; torch.ones(1, device="cuda"); print("MPS client ok")'; then
    MPS=1
    log "MPS started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
  else
    log "MPS did not start or no client could connect: ranks run time-sliced"
    mps_quit
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    FAILED=$failed_before  # not a failure of ringdp; the summary records mps=false
  fi
  echo "$MPS" > "$WORK/mps_used"
}

copy_mps_logs() { [ -d "$MPS_DIR/log" ] && cp -r "$MPS_DIR/log" "$WORK/mps_log" 2>/dev/null; return 0; }

log "phase $PHASE in $ROOT, budget ${BUDGET}s, python $PY"
case "$PHASE" in
# ------------------------------------------------------------------ build
build)
  step nvidia_smi 30 nvidia-smi || true
  step nvidia_smi_q 30 nvidia-smi -q || true
  step nvcc 30 bash -c 'command -v nvcc && nvcc --version' || true
  cat > "$WORK/facts.py" <<'EOF'
import json, os, platform, shutil, sys
info = {"python": sys.executable, "python_version": platform.python_version(), "platform": platform.platform(),
        "cpu_cores": os.cpu_count(), "mps_control": bool(shutil.which("nvidia-cuda-mps-control"))}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_GiB=round(p.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
        try:
            info["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:
            info["nccl_torch"] = f"unavailable: {e}"
except Exception as e:
    info["torch"] = f"unavailable: {e}"
for mod in ("numpy", "pybind11", "ninja", "pytest", "matplotlib"):
    try:
        info[mod] = getattr(__import__(mod), "__version__", "present")
    except Exception as e:
        info[mod] = f"missing: {e}"
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
sys.exit(0 if info.get("cuda_available") else 1)
EOF
  step facts 120 "$PY" "$WORK/facts.py" "$WORK/facts.json" || true
  CAP="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("capability",""))' "$WORK/facts.json" 2>/dev/null)"
  if [ -z "$CAP" ]; then
    log "no CUDA device visible to torch: nothing to build for"
    exit 3
  fi
  export RINGDP_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$CAP}" MAX_JOBS="${MAX_JOBS:-16}"
  step build 600 "$PY" setup.py build_ext --inplace || true
  if ! step build_info 60 "$PY" -c 'import json, sys, ringdp; i = ringdp.build_info(); print(json.dumps(i)); sys.exit(0 if i.get("cuda") else 3)'; then
    log "ringdp.build_info()['cuda'] is not True: stopping"
    exit 3
  fi
  step nccl_loadable 60 "$PY" -c 'from ringdp import _C; ok = bool(_C.cuda_nccl_available()); print("libnccl loadable:", ok); raise SystemExit(0 if ok else 1)' || true
  step protocol_sim 120 "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py::test_protocol_simulation \
    --junitxml="$WORK/test_protocol_simulation.xml" || true
  step nccl_library 60 "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py::test_nccl_library_named_is_the_one \
    --junitxml="$WORK/test_nccl_library_named_is_the_one.xml" || true
  ;;
# ------------------------------------------------------------------ priority
priority)
  need_cuda_build
  BUDGET_SKIP_FAILS=0  # it runs what fits: the rest is listed as skipped, not a failure
  # most used first, limits ~3x the ~13-15 s a test took on the H100: the core paths whose
  # code changed since the first GPU run (bad0456: the IPC matrix, Work, RingDDP, NCCL, a
  # killed peer) among the tests that never ran on a GPU (the halves, the backend on CUDA,
  # two simulated hosts); a killed peer early: the NCCL watchdog and a struck Work's
  # is_success()/exception() (2026-12-05) have never run
  cuda_test 60 "test_ipc_matrix[2-default]"
  cuda_test 45 "test_cuda_halves[ipc-2]"
  cuda_test 45 "test_ipc_halves_registered[2]"
  cuda_test 45 "test_cuda_work_semantics[ipc]"
  cuda_test 45 "test_ringddp_cuda_matches_single_process[ipc]"
  cuda_test 45 "test_backend_stock_ddp_cuda[cpu:ringdp,cuda:ringdp]"
  cuda_test 45 test_backend_halves_cuda
  cuda_test 45 "test_nccl_world2[default]"
  cuda_test 60 "test_cuda_halves[nccl-2]"
  cuda_test 60 "test_nccl_peer_killed[torch]"
  cuda_test 45 "test_ipc_peer_killed[during]"
  cuda_test 45 test_ipc_ctrl_c_at_close
  cuda_test 75 "test_cuda_two_hosts[two_level]"
  cuda_test 60 test_ringddp_cuda_two_hosts
  cuda_test 60 "test_cuda_two_hosts_halves[two_level-False]"
  cuda_test 45 "test_ipc_halves_mismatch_raises[ring]"
  cuda_test 45 "test_ipc_broadcast_roots_disagree_raises[many-slices]"
  cuda_test 60 "test_cuda_two_hosts_host_dies[during]"
  cuda_test 60 test_cuda_two_hosts_aborted_cross_step_fails_host_peers
  cuda_test 45 test_cuda_two_hosts_mismatch_raises
  cuda_test 60 "test_cuda_two_hosts[leaders]"
  cuda_test 45 "test_backend_stock_ddp_cuda[cpu:ringdp,cuda:nccl]"
  cuda_test 60 "test_nccl_peer_killed[ringdp]"
  cuda_test 60 test_nccl_peer_dies_before_init
  cuda_test 45 test_registered_tensor_freed_in_flight
  cuda_test 45 "test_cuda_min_max_ignore_nan[ipc]"
  cuda_test 45 "test_graph_capture[ringdp]"
  cuda_test 45 test_ringddp_cuda_complex_parameters
  ;;
# ------------------------------------------------------------------ smoke
smoke)
  need_cuda_build
  # cheapest first: the bare binding, then the IPC ring and one-shot, streams, DDP
  # (each test ~12-15 s on an H100: 16 of them fit the default budget; NCCL and the IPC
  # failure paths: phase nccl)
  cuda_test 60 test_native_api_ipc
  cuda_test 90 "test_ipc_matrix[2-default]"
  cuda_test 60 "test_ipc_matrix[2-oneshot]"
  cuda_test 60 "test_ipc_registered[default-2]"
  cuda_test 60 "test_cuda_halves[ipc-2]"
  cuda_test 60 "test_cuda_halves[ipc-oneshot-2]"
  cuda_test 60 "test_ipc_halves_registered[2]"
  cuda_test 45 "test_ipc_halves_mismatch_raises[ring]"
  cuda_test 45 "test_ipc_halves_mismatch_raises[oneshot]"
  cuda_test 45 "test_ipc_broadcast_roots_disagree_raises[many-slices]"
  cuda_test 45 "test_ipc_broadcast_roots_disagree_raises[oneshot]"
  cuda_test 45 "test_ipc_mismatch_raises[ring]"
  cuda_test 45 "test_ipc_mismatch_raises[oneshot]"
  cuda_test 45 "test_stream_ordering[ipc]"
  cuda_test 45 "test_cuda_work_semantics[ipc]"
  cuda_test 45 "test_ringddp_cuda_matches_single_process[ipc]"
  cuda_test 45 "test_cuda_min_max_ignore_nan[ipc]"
  cuda_test 45 "test_graph_capture[ringdp]"
  ;;
# ------------------------------------------------------------------ nccl
nccl)
  need_cuda_build
  # (the IPC failure paths first: they take ~30 s each and did not fit the smoke phase)
  cuda_test 60 test_ipc_memory_released
  cuda_test 60 "test_ipc_peer_killed[before]"
  cuda_test 60 "test_ipc_peer_killed[during]"
  cuda_test 90 "test_nccl_world2[default]"
  cuda_test 90 "test_cuda_halves[nccl-2]"
  cuda_test 45 "test_stream_ordering[nccl]"
  cuda_test 45 "test_cuda_work_semantics[nccl]"
  cuda_test 45 "test_ringddp_cuda_matches_single_process[nccl]"
  cuda_test 60 "test_backend_stock_ddp_cuda[cpu:ringdp,cuda:ringdp]"
  cuda_test 60 "test_backend_stock_ddp_cuda[cpu:ringdp,cuda:nccl]"
  cuda_test 60 test_backend_halves_cuda
  cuda_test 60 "test_cuda_min_max_ignore_nan[nccl]"
  cuda_test 60 "test_graph_capture[backend]"
  ;;
# ------------------------------------------------------------------ hosts
hosts)
  need_cuda_build
  cuda_test 120 "test_cuda_two_hosts[two_level]"
  cuda_test 90 "test_cuda_two_hosts_halves[two_level-False]"
  cuda_test 60 test_cuda_two_hosts_mismatch_raises
  cuda_test 60 "test_cuda_two_hosts_host_dies[during]"
  cuda_test 60 test_cuda_two_hosts_aborted_cross_step_fails_host_peers
  cuda_test 60 test_ringddp_cuda_two_hosts
  cuda_test 90 "test_cuda_two_hosts[leaders]"
  cuda_test 90 "test_cuda_two_hosts_halves[leaders-False]"
  cuda_test 90 "test_cuda_two_hosts_halves[two_level-True]"
  cuda_test 90 "test_cuda_two_hosts[flat]"
  cuda_test 60 "test_cuda_two_hosts_host_dies[before]"
  # a first figure (time-sliced, NCCL over sockets between the "hosts"): two levels against
  # the nccl baseline and ringdp's flat NCCL ring; its JSON goes into hosts.tar.gz
  mkdir -p "$WORK/bench"
  step bench_hosts_cuda 100 env RINGDP_NCCL_HOSTID_PER_RANK=1 RINGDP_CUDA_CHANNELS=16 RINGDP_CUDA_ARENA_MB=1024 \
    "$PY" bench/allreduce.py --device cuda --hosts 2 -b 64K -e 256M -f 4 --target-time 0.05 --max-iters 200 \
    --timeout 300 --out-dir "$WORK/bench" --name ipc_nccl || true
  ;;
# ------------------------------------------------------------------ mps
mps)
  need_cuda_build
  mps_start
  cuda_test 60 "test_ipc_matrix[3-default]"
  cuda_test 60 "test_ipc_matrix[4-default]"
  cuda_test 45 "test_ipc_matrix[4-oneshot]"
  cuda_test 60 "test_ipc_matrix[4-tiny-ring]"
  cuda_test 45 "test_ipc_registered[tiny-ring-3]"
  cuda_test 45 "test_ipc_matrix[2-tiny-ring]"
  cuda_test 45 "test_ipc_registered[default-3]"
  cuda_test 45 "test_ipc_matrix[3-oneshot]"
  cuda_test 45 "test_ipc_matrix[3-tiny-ring]"
  cuda_test 45 "test_ipc_registered[tiny-ring-2]"
  cuda_test 45 "test_nccl_world2[tiny]"
  cuda_test 60 "test_cuda_halves[ipc-3]"
  cuda_test 60 "test_cuda_halves[ipc-oneshot-3]"
  cuda_test 60 "test_ipc_halves_registered[3]"
  cuda_test 90 "test_cuda_halves[nccl-3]"
  cuda_test 90 "test_ipc_large[2]"
  cuda_test 90 "test_ipc_large[4]"
  copy_mps_logs
  ;;
# ------------------------------------------------------------------ bench
bench)
  need_cuda_build
  cat > "$WORK/copy_bw.py" <<'EOF'
import json, sys
import torch
n = 1 << 30  # bytes per buffer
src = torch.ones(n // 4, device="cuda")
dst = torch.empty_like(src)
res = {}
for name, streams, fn in (("copy_", 2, lambda: dst.copy_(src)), ("add_", 3, lambda: dst.add_(src))):
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    res[name] = {"bytes_per_call": streams * n, "GBps": streams * n / times[0] / 1e9,
                 "median_GBps": streams * n / times[len(times) // 2] / 1e9}
res["copy_GBps"] = res["copy_"]["GBps"]
res["counts"] = "bytes read + bytes written per second"
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res, indent=1))
EOF
  step copy_bw 60 "$PY" "$WORK/copy_bw.py" "$WORK/copy_bw.json" || true
  mps_start
  mkdir -p "$WORK/bench"
  SWEEP=(-b 8K -e 256M -f 4 --target-time 0.05 --max-iters 500 --timeout 300 --out-dir "$WORK/bench")
  export RINGDP_CUDA_ARENA_MB=1024  # registered tensors up to 256 MiB in the IPC arena
  # the nccl baseline (NCCL_HOSTID per rank, over sockets) once, in the first sweep; every
  # sweep rewrites its JSON after each size, so one cut short by its limit keeps its rows
  step bench_ipc_w2 100 env RINGDP_TRANSPORT=ipc "$PY" bench/allreduce.py --device cuda --world 2 "${SWEEP[@]}" \
    --name ipc || true
  step bench_ipc_w4 90 env RINGDP_TRANSPORT=ipc "$PY" bench/allreduce.py --device cuda --world 4 "${SWEEP[@]}" \
    --no-baseline --name ipc || true
  # ringdp over NCCL: ranks of one GPU look like separate hosts to NCCL (sockets between
  # them): a correctness and overhead figure, not a bandwidth one; up to 64 MiB
  step bench_nccl_w2 70 env RINGDP_TRANSPORT=nccl RINGDP_NCCL_HOSTID_PER_RANK=1 "$PY" bench/allreduce.py \
    --device cuda --world 2 "${SWEEP[@]}" -e 64M --no-baseline --name nccl || true
  step bench_nccl_w4 70 env RINGDP_TRANSPORT=nccl RINGDP_NCCL_HOSTID_PER_RANK=1 "$PY" bench/allreduce.py \
    --device cuda --world 4 "${SWEEP[@]}" -e 64M --no-baseline --name nccl || true
  copy_mps_logs
  ;;
# ------------------------------------------------------------------ probe
probe)
  need_cuda_build
  mps_start
  mkdir -p "$WORK/probe"
  # the IPC ring's spinning blocks against the backward's kernels: RingDDP's step for each
  # channel count (auto: as many as the SMs allow, up to 64 per rank)
  for CH in auto 32 16 8 4; do
    if [ "$CH" = auto ]; then CH_ENV=(-u RINGDP_CUDA_CHANNELS); else CH_ENV=(RINGDP_CUDA_CHANNELS="$CH"); fi
    step "probe_ch$CH" 45 env "${CH_ENV[@]}" RINGDP_TRANSPORT=ipc "$PY" bench/cuda_probe.py --world 2 \
      --out "$WORK/probe" --name "ch$CH" || true
  done
  copy_mps_logs
  ;;
# ------------------------------------------------------------------ cpu
cpu)
  # CPU tensors only: issue 12's two-level all-reduce (2 simulated hosts x 2 ranks, >= 2x
  # flat gloo from 16 MiB) and issue 11's stock DDP (<= 0.6x gloo's step, H=2560) and FSDP2
  # (aim <= 0.5x) where the ranks, their copies and the loopback "network" each have cores
  # of their own; on the 2-core development box they share two. One thread per rank, as there.
  # The sweep's parts (the in-host steps and the gloo step timed alone) show whether the
  # pieces' pipeline hides one behind the other once there are cores to spare.
  step cpu_facts 30 bash -c 'nproc; lscpu | head -n 20; df -h /dev/shm; free -g' || true
  if ! "$PY" -c 'import ringdp._C' > /dev/null 2>&1; then  # no build phase ran on this machine
    step build_cpu 180 env RINGDP_BUILD_CUDA=0 MAX_JOBS=16 "$PY" setup.py build_ext --inplace \
      || { log "the CPU build failed: nothing to measure"; exit 1; }
  fi
  mkdir -p "$WORK/cpu"
  step bench_hosts2 60 "$PY" bench/allreduce.py --hosts 2 -b 1M -e 64M -f 4 \
    --series baseline,ringdp,ringdp-reg,ringdp-flat,parts --min-iters 10 --target-time 0.5 --timeout 120 \
    --out-dir "$WORK/cpu" --name cores || true
  step ddp_step 60 "$PY" bench/ddp_step.py --hidden 2560 --modes none,torch,ring,torch_ringdp,torch_nocomm \
    --rounds 5 --out-dir "$WORK/cpu" --name cores || true
  step fsdp_step 60 "$PY" bench/fsdp_step.py --rounds 5 --out-dir "$WORK/cpu" --name cores || true
  ;;
esac
log "phase $PHASE done: $([ "$FAILED" = 0 ] && echo 'every step passed' || echo 'some steps failed')"
exit "$FAILED"
