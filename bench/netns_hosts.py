"""Two hosts on this machine in Linux namespaces, and a torchrun job across them.

    python bench/netns_hosts.py [--rate 2gbit] [--nproc-per-node 2] -- bench/allreduce.py ARGS...

Each host is a network namespace of its own, the two joined by a veth pair (10.S.77.1 and
.2 on a /24 of their own); each launcher enters its host's network namespace, then a UTS and
mount namespace of its own where it takes a hostname (ringdp-<pid>-<k>), a private
/dev/shm and an /etc/hosts naming both hosts. So ringdp finds two hosts from hostname and
boot id, as on real machines (no RINGDP_HOST_ID), the shared memory of one host is not
seen by the other, and every byte between hosts (the store, gloo) crosses the veth link,
not loopback. `--rate` shapes each host's sending side of the link with a token bucket
(tc tbf, e.g. 2gbit): a network slower than the hosts' memory, as between real hosts.
The hosts still share this machine's cores.

The job: `torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d` on each host, the
store on host 0's address, then SCRIPT ARGS. Host 0's output is this command's; host 1's
is printed if it fails. The ranks get BENCH_NETWORK (bench/_common.py machine_info
records it as "network") and, where the ranks of both hosts outnumber the cores,
RINGDP_SPIN_US at the oversubscribed spin (ringdp counts ranks per hostname, which here
differs per host; policy.spin_ns) unless it is set.

Needs root, iproute2 (ip, tc) and util-linux (unshare, mount); tests/test_hierarchy.py
uses `two_hosts`, `launch` and `set_link` (it skips where the machine does not allow namespaces);
tests/test_leftovers.py uses `launch` on loopback for a world that grows or shrinks.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile


class Unavailable(RuntimeError):
    """This machine does not allow the namespaces (not root, a tool missing, a refused step)."""


@contextlib.contextmanager
def two_hosts(workdir: str, rate: str | None = None):
    """Make the two hosts (module doc) for the duration of the block; yields a dict with
    `prefix` (per host: the command prefix that enters it), `addr`, `name`, and `netns` and
    `dev` (its network namespace and its end of the link; set_link) per host.
    Raises Unavailable when the machine does not allow them. On every exit it kills what
    still runs inside them (a torchrun worker sits in a session of its own: killing its
    launcher leaves it), then removes them and the link. Names carry this process's id: one
    left by a dead process with the same id is removed first."""
    tools = ("ip", "unshare", "mount", "hostname") + (("tc",) if rate else ())
    if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
        raise Unavailable(f"network namespaces need root and {', '.join(tools)}")
    pid = os.getpid()
    tag, sub = f"rdp{pid}", 16 + pid % 200
    ns, dev = [f"{tag}a", f"{tag}b"], [f"{tag}x", f"{tag}y"]
    addr = [f"10.{sub}.77.1", f"10.{sub}.77.2"]
    name = [f"ringdp-{pid}-{k}" for k in range(2)]
    steps = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
             ["ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1]]]
    for k in range(2):
        steps += [["ip", "link", "set", dev[k], "netns", ns[k]],
                  ["ip", "-n", ns[k], "addr", "add", f"{addr[k]}/24", "dev", dev[k]],
                  ["ip", "-n", ns[k], "link", "set", dev[k], "up"], ["ip", "-n", ns[k], "link", "set", "lo", "up"]]
        if rate:
            steps.append(["ip", "netns", "exec", ns[k], "tc", "qdisc", "add", "dev", dev[k], "root", "tbf",
                          "rate", rate, "burst", "256kb", "latency", "50ms"])
    hosts = os.path.join(workdir, "hosts")

    def remove():
        for n in ns:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for p in pids:
                with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                    os.kill(int(p), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        subprocess.run(["ip", "link", "del", dev[0]], capture_output=True)  # (set-up stopped before moving it)

    remove()
    try:
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True)
            if r.returncode != 0:
                raise Unavailable(f"{' '.join(step)}: {r.stderr.strip() or r.returncode}")
        with open(hosts, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(addr, name)))
        enter = 'hostname "$0" && mount -t tmpfs tmpfs /dev/shm && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        yield {"prefix": [["ip", "netns", "exec", ns[k], "unshare", "--uts", "--mount", "sh", "-c", enter,
                           name[k], hosts] for k in range(2)],
               "addr": addr, "name": name, "netns": ns, "dev": dev}
    finally:
        remove()


def set_link(hosts: dict, k: int, up: bool) -> None:
    """Take host k's end of the link down (or up again): the hosts and their processes stay,
    nothing passes between them (a cable pulled, a switch port dead)."""
    subprocess.run(["ip", "-n", hosts["netns"][k], "link", "set", hosts["dev"][k], "up" if up else "down"],
                   check=True, capture_output=True)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc), e.g. a torchrun agent's workers."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def launch(hosts: dict, script: list[str], port: int, nproc: int | list[int] = 2, env: dict | None = None,
           timeout: float = 600, rdzv_id: str = "netns", stream: bool = False, watch=None,
           stop_on_failure: bool = True, nnodes: str = "2", rdzv_conf: str = "",
           torchrun_args: tuple[str, ...] = (), start_second=None, kill_second=None) -> list[tuple[int, str]]:
    """Run `script` (a command line after torchrun's own arguments) under a torchrun
    launcher on each host of `hosts` (two_hosts; or any dict of `prefix` and `addr` per
    host, and optionally `env` per host: tests/test_hierarchy.py runs two launchers on
    loopback with a RINGDP_HOST_ID each), the c10d store on host 0 at `port`; the ranks get
    this process's environment without RINGDP_HOST_ID, plus `env`, plus the host's own.
    `nproc`: ranks per host (a list: per host; hosts of different sizes). `nnodes`:
    torchrun's --nnodes ("1:2": an elastic job, tests/test_leftovers.py); `rdzv_conf`: more
    of --rdzv-conf ("last_call_timeout=1,..."); `torchrun_args`: more of torchrun's
    arguments (e.g. --max-restarts 1).
    A world that changes: with `start_second`, host 1's launcher starts once
    `start_second()` returns True (a node joining); once `kill_second()` returns True, host
    1's launcher and every process below it are SIGKILLed (a whole host dying; that host's
    end is no failure for `stop_on_failure`). Both are called every 0.2 s, as `watch` is.
    Waits for both; ends them once `timeout` seconds have passed, one launcher failed
    (`stop_on_failure`: the other would wait for it), `watch()` returned True, or on any
    exception: SIGTERM (torchrun then ends its workers), then 10 s later SIGKILL to the
    launcher's process group and to every process below it (torchrun starts each worker in
    a session of its own).
    Returns (return code, output) per host (negative for one ended so; host 0's output ""
    with `stream`: it went to stdout; (None, "") for a host 1 that never started)."""
    import time

    from _common import child_pythonpath  # (bench/ is this script's directory)

    base = {k: v for k, v in os.environ.items() if k != "RINGDP_HOST_ID"}
    base["PYTHONPATH"] = child_pythonpath()
    procs, logs = [], []

    def start(k):
        n = nproc[k] if isinstance(nproc, (list, tuple)) else nproc
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", str(n),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts['addr'][0]}:{port}",
               "--rdzv-id", rdzv_id, "--rdzv-conf", ",".join([f"is_host={int(k == 0)}"] + [rdzv_conf] * bool(rdzv_conf)),
               *torchrun_args]
        log = None if stream and k == 0 else tempfile.TemporaryFile("w+")  # (a pipe could fill and stall it)
        logs.append(log)
        own = hosts["env"][k] if "env" in hosts else {}
        procs.append(subprocess.Popen(hosts["prefix"][k] + cmd + script, env={**base, **(env or {}), **own},
                                      stdout=log, stderr=subprocess.STDOUT if log else None, text=True,
                                      start_new_session=True))

    def kill(p):
        for q in [p.pid, *_descendants(p.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(q, signal.SIGKILL)
        p.wait()

    killed = False
    try:
        start(0)
        if start_second is None:
            start(1)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if len(procs) == 1 and start_second():
                start(1)
            if len(procs) == 2 and kill_second is not None and not killed and kill_second():
                kill(procs[1])
                killed = True
            if stop_on_failure and any(p.poll() not in (None, 0) for p in procs[:1 if killed else 2]):
                break
            if watch is not None and watch():
                break
            time.sleep(0.2)
    finally:
        below = {p.pid: _descendants(p.pid) for p in procs if p.poll() is None}
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            for q in below.get(p.pid, []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(q, signal.SIGKILL)
            p.wait()
    results = []
    for p, log in zip(procs, logs):
        text = ""
        if log is not None:
            log.seek(0)
            text = log.read()
            log.close()
        results.append((p.returncode, text))
    return results + [(None, "")] * (2 - len(results))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", help="shape each host's sending side of the link (tc tbf rate, e.g. 2gbit)")
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before both launchers are killed")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...: what torchrun runs on each host")
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the job after --, e.g. -- bench/allreduce.py --series baseline,ringdp")
    if args.nproc_per_node < 1:
        ap.error("--nproc-per-node must be >= 1")
    from _common import free_port  # (bench/ is this script's directory)

    from ringdp import policy

    def on_term(signum, frame):  # (a caller's timeout: the namespaces and what runs in them go too)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    network = f"2 hosts in network namespaces, one veth link, {args.rate + ' each way (tc tbf)' if args.rate else 'unshaped'}"
    env = {"BENCH_NETWORK": network}
    cores = len(os.sched_getaffinity(0))
    if 2 * args.nproc_per_node > cores and "RINGDP_SPIN_US" not in os.environ:
        env["RINGDP_SPIN_US"] = f"{policy.SPIN_NS_OVERSUBSCRIBED / 1000:g}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with two_hosts(tmp, args.rate) as hosts:
                print(f"# {network}: {hosts['name'][0]} {hosts['addr'][0]}, {hosts['name'][1]} {hosts['addr'][1]}",
                      flush=True)
                (rc0, _), (rc1, log1) = launch(hosts, script, free_port(), args.nproc_per_node, env, args.timeout,
                                               stream=True)
        except Unavailable as e:
            print(f"netns_hosts: this machine does not allow the namespaces: {e}", file=sys.stderr)
            return 2
    if rc1 != 0:
        print(f"# host 1 ended with {rc1}:\n{log1[-4000:]}", file=sys.stderr)
    return rc0 or rc1


if __name__ == "__main__":
    sys.exit(main())
