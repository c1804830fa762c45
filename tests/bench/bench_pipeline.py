"""Benchmark: the pipeline bubble, measured against (p - 1) / (v m + p - 1).

Runs distrain-train as p pipeline stages (one process each, one compute thread, rendezvous
through a temporary DISTRAIN_KV_DIR) on a balanced model, m micro-batches per step, under GPipe,
1F1B and interleaved 1F1B with v = 2 model chunks per stage (v = 1 for the others). Balanced:
8 layers of C256 per stage and a vocabulary of 128, so that the last stage's LM head, final
LayerNorm and loss add about 1% to its last chunk's work (with 4 layers and a vocabulary of
256 they added 4-5% to an interleaved chunk, and every stage before it waited that long per
micro-batch). The "imbalance" column is the measured spread of the stages' compute time
(slowest / fastest - 1), which also holds the run-to-run noise of the machine.
Each stage reports the share of its pipeline time it spent waiting for its neighbours. The
table prints the first stage's next to the ideal bubble (as the per-step metrics do), and the
other stages' range: a step's pipeline ends, for the whole pipeline, with the first stage's last
backward pass (the flush), while a later stage's pipeline time ends with its own last transfer,
so its wait for the flush falls in the step's next collective and the pipeline time undercounts
it (gpipe p=2 m=4: first stage 21.9%, second 8.7%, ideal 20%). Waiting includes the
point-to-point transfers themselves (loopback TCP here).

A stage needs a core of its own for its waiting time to mean anything: with p stages on
fewer cores, stages also wait for the CPU. When the cores suffice, stage r is pinned to the r-th
core of the list this process may use (its compute thread and its communicator's threads alike),
as a trainer per device is pinned on a GPU node. The list takes one hardware thread of each
physical core before any second one (two stages on the siblings of one core would share its
units), and CPU 0, which serves most interrupts, last; the header prints the cores used and the
rows each stage's compute time, since a stage slower than its neighbours is what the bubble
then measures (the first p = 4 rows on a 16-core GPU machine had stages 93-359% apart), and
each core's load by others: the share of the run it was busy with anything but its stages
(other processes, interrupts: /proc/stat's busy time less the stages' own CPU time, from
wait4; pinned rows only), with the share a hypervisor stole where there is any. A slow stage on a core others
load is that machine's doing; one on a quiet core is the model's or the schedule's.
Unpinned, the scheduler moves the stages' threads between cores, and every move shows up as
waiting at the next exchange (measured here: interleaved p=2 m=16 at 13% unpinned against 6.8%
pinned, for an ideal 3.0%).

With more stages than cores (p = 4 on a 2-core machine), k = p / cores neighbouring stages share
a core, each held to 0.9 / k of it by the kernel's CPU bandwidth control (a cgroup per stage:
cpu.max in cgroup v2, cpu.cfs_quota_us in v1; root, or a delegated cgroup, is needed), in
periods of 2.25 ms (longer where a share of one would be under the kernel's least quota, 1 ms:
4.4 ms for 4 stages a core). The shares sum to less than the core, so a stage runs at the same
speed whether its core's other stages compute or wait: p slower cores, on which the bubble, a
ratio of times, would be the same. The row says "throttled 45%", say; where no cgroup can be
made it says "oversubscribed" and means little. It is an approximation, and its cost is in the
transfers: a stage woken while its quota is spent waits for the next period, and the
communicator's I/O thread (idle class on a one-core trainer) runs only when its core's other
stage leaves it room, so an exchange took 5-13 ms at the median here (DISTRAIN_DEBUG=trace, p=4
interleaved m=8, --batch 4) against 0.7-1 ms pinned, and a stage's ops about 2.5 times as long
as pinned (not 1 / 0.45). That waiting counts in the bubble, so throttled rows want long ops:
--batch 16 (ops of 0.5-1 s) kept all 9 p=4 rows within 3 points here (2.2 at most); --batch 8
(200-400 ms) left interleaved m=8 and m=16 up to 3.6 above, and --batch 4 2-7 points. --cores N uses only the first N cores, so that throttled rows can be checked against
pinned ones: p = 2 with --cores 1 --batch 4 measured here within 3 points of the same rows
pinned on 2 cores, either way (interleaved m=16: 4.8% throttled, 4.3% pinned, for an ideal
3.0%), about the spread of two pinned runs. --batch (default 2) sets the sequences per
micro-batch.

The ideal bubble is that of a balanced pipeline, and a stage that another process slowed is
not the model's imbalance but the machine's: --repeat N runs a row again while its stages'
compute times are more than --balanced % apart (default 3, about the spread of quiet runs
here), up to N runs in all, and prints the most balanced, with every run's imbalance after
"most balanced of". Each run's figures are its own; none are averaged.

    /usr/bin/python3 tests/bench/bench_pipeline.py --build build [--stages 2 4] [--micro 4 8 16]
        [--schedules gpipe 1f1b interleaved] [--batch B] [--cores N] [--require-cores N]
        [--repeat N] [--balanced PCT]

--require-cores N exits 77 (skipped) where fewer than N cores are allowed: tests/gpu/run.sh
runs it so on the GPU machines (16 cores), which pin every stage of p = 4 to a core of its own.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS_PER_STAGE, VOCAB = 8, 128
PERIOD_US = 2250  # the CPU bandwidth control's period for a throttled stage (its quota: >= 1 ms)


def cpu_cgroup():
    """(version, directory) of this process's cgroup where the cpu controller is, or None."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            own[controllers] = path
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            root, mount = left.split()[3:5]
            fstype, _, options = right.split()[:3]
            if fstype == "cgroup" and "cpu" in options.split(","):
                path = next((p for c, p in own.items() if "cpu" in c.split(",")), None)
            elif fstype == "cgroup2" and "" in own:
                path = own[""]
            else:
                continue
            if path is None:
                continue
            if root != "/" and path.startswith(root):
                path = path[len(root):]
            directory = mount + path.rstrip("/")
            if fstype == "cgroup":
                return 1, directory
            with open(os.path.join(directory, "cgroup.controllers")) as c:
                if "cpu" in c.read().split():
                    return 2, directory
    return None


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def make_groups(n, share):
    """n cgroups, each holding its processes to `share` of a core; [] where none can be made."""
    found = cpu_cgroup()
    if not found:
        return []
    version, parent = found
    period = max(PERIOD_US, int(1000 / share) + 1)  # the kernel's least quota is 1 ms
    quota, groups = int(share * period), []
    try:
        if version == 2:
            write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
        for r in range(n):
            d = os.path.join(parent, "dt_bench_pipeline_%d_%d" % (os.getpid(), r))
            os.mkdir(d)
            groups.append(d)
            if version == 2:
                write(os.path.join(d, "cpu.max"), "%d %d" % (quota, period))
            else:
                write(os.path.join(d, "cpu.cfs_period_us"), str(period))
                write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))
    except OSError:
        remove_groups(groups)
        return []
    return groups


def remove_groups(groups):
    for d in groups:
        try:
            os.rmdir(d)
        except OSError:
            pass


def core_order(cpus):
    """cpus with one hardware thread of each physical core first, CPU 0 last."""
    def siblings(c):
        try:
            with open("/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list" % c) as f:
                return f.read().strip()
        except OSError:
            return str(c)
    seen, first, rest = set(), [], []
    for c in sorted(cpus, key=lambda c: (c == 0, c)):
        core = siblings(c)
        (rest if core in seen else first).append(c)
        seen.add(core)
    return first + rest


def place(cpu, group):
    """In the child before exec: run on that core only (left unpinned where the kernel refuses),
    in that cgroup (None: none)."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    if group:
        write(os.path.join(group, "cgroup.procs"), str(os.getpid()))


def cpu_ticks():
    """{cpu: (busy, steal, total)} in clock ticks since boot, from /proc/stat (busy: user, nice,
    system, irq and softirq; steal: time the hypervisor ran something else; total: all of it)."""
    ticks = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                t = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                ticks[int(name[3:])] = (t[0] + t[1] + t[2] + t[5] + t[6], t[7], sum(t))
    return ticks


def reap(procs, timeout):
    """Waits for every process (Popen) and returns each one's CPU seconds, user and system, all
    its threads (wait4's resource usage); a process still running at the deadline is killed."""
    deadline, used = time.time() + timeout, [None] * len(procs)
    while None in used:
        for i, proc in enumerate(procs):
            if used[i] is None:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    used[i] = ru.ru_utime + ru.ru_stime
        if None in used and time.time() > deadline:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
            sys.exit("a stage ran past %d s" % timeout)
        time.sleep(0.02)
    return used


def others_load(before, after, placed_on, cpu_s):
    """Per core the stages ran on (in their order): the share of the run's time it was busy with
    anything but them (other processes, interrupts) and the share a hypervisor stole, in %."""
    hz = os.sysconf("SC_CLK_TCK")
    others, steal = [], []
    for c in dict.fromkeys(placed_on):
        busy, stolen, total = (a - b for a, b in zip(after[c], before[c]))
        own = sum(s for s, on in zip(cpu_s, placed_on) if on == c)
        others.append(max(0.0, 100.0 * (busy / hz - own) / (total / hz)) if total else 0.0)
        steal.append(100.0 * stolen / total if total else 0.0)
    return others, steal


def run(build, shard, p, m, schedule, steps, tmp, chunks, cpus, batch):
    """Each stage's waiting shares, the stages' compute times, how they were placed and, for each
    core they ran on, its load by others and steal (%: others_load; pinned runs only: under the
    CPU bandwidth control /proc/stat's tick-sampled busy time ran 17 points above a throttled
    process's own CPU time here, where a pinned one's matched within 0.1)."""
    kv = tempfile.mkdtemp(prefix="kv_p%d_m%d_%s_" % (p, m, schedule), dir=tmp)
    cmd = [os.path.join(build, "worker", "trainer", "distrain-train"), "--init", "seed:1",
           "--layers", str(LAYERS_PER_STAGE * p), "--heads", "4", "--channels", "256",
           "--vocab", str(VOCAB),
           "--max-seq", "128", "--train", shard, "--batch", str(batch), "--seq", "128",
           "--grad-accum", str(m), "--steps", str(steps), "--lr", "1e-4", "--threads", "1",
           "--quiet", "--pp", str(p), "--pp-schedule", schedule]
    if chunks > 1:
        cmd += ["--pp-virtual", str(chunks)]
    k = -(-p // len(cpus))  # stages a core
    groups = make_groups(p, 0.9 / k) if k > 1 else []
    placed = k == 1 or groups
    procs, logs = [], []
    before = cpu_ticks()
    try:
        for r in range(p):
            env = dict(os.environ, WORLD_SIZE=str(p), RANK=str(r), DISTRAIN_KV_DIR=kv,
                       OMP_NUM_THREADS="1", DISTRAIN_COMM_HOST="127.0.0.1")
            pin = (lambda c=cpus[r // k], g=groups[r] if groups else None: place(c, g)
                   ) if placed else None
            logs.append(tempfile.TemporaryFile("w+", dir=tmp))
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          preexec_fn=pin, stderr=logs[-1]))
        cpu_s = reap(procs, 900)
        load = others_load(before, cpu_ticks(), cpus[:p], cpu_s) if k == 1 else None
        bubbles, busy = [], []
        for r, proc in enumerate(procs):
            logs[r].seek(0)
            err = logs[r].read()
            if proc.returncode != 0:
                sys.exit("stage %d failed:\n%s" % (r, err[-2000:]))
            found = re.search(r"busy ([\d.]+) ms.*bubble ([\d.]+)%", err)
            busy.append(float(found.group(1)))
            bubbles.append(float(found.group(2)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        remove_groups(groups)
    how = ("pinned" if k == 1 else "throttled %d%%" % round(90 / k) if groups
           else "oversubscribed")
    return bubbles, busy, how, load


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--cores", type=int, default=0, help="use only the first N cores")
    ap.add_argument("--require-cores", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run an unbalanced row (see --balanced) up to N times in all")
    ap.add_argument("--balanced", type=float, default=3.0,
                    help="the imbalance %% up to which a run counts as balanced")
    args = ap.parse_args()
    if args.repeat < 1 or args.balanced < 0:
        ap.error("--repeat must be >= 1 and --balanced >= 0")
    cpus = core_order(os.sched_getaffinity(0))
    if args.cores > 0:
        cpus = cpus[:args.cores]
    cores = len(cpus)
    if cores < args.require_cores:
        print("bench_pipeline: %d cores here, %d required: skipped" % (cores, args.require_cores))
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "tokens.bin")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tokens.py"), "--out", shard,
                        "--tokens", "2000000", "--vocab", str(VOCAB), "--seed", "0"], check=True,
                       stdout=subprocess.DEVNULL)
        print("pipeline bubble: stages p, micro-batches m; %d layers per stage of C256, "
              "vocabulary %d, batch %d x 128 per micro-batch; %d cores, stage r on %s"
              % (LAYERS_PER_STAGE, VOCAB, args.batch, cores,
                 ",".join(str(c) for c in cpus[:max(args.stages)])))
        print("%-3s %-4s %-14s %9s %11s %18s %12s  %s" % (
            "p", "m", "sched", "ideal %", "measured %", "later stages %", "imbalance %",
            "compute ms by stage; the cores' load by others (and steal) %"))
        for p in args.stages:
            for m in args.micro:
                for schedule in args.schedules:
                    v = 2 if schedule == "interleaved" else 1
                    if m % p and v > 1:
                        continue  # interleaving takes micro-batches in groups of p
                    tries = []  # (imbalance %, run), until one is balanced or --repeat ran
                    while len(tries) < args.repeat and (not tries or tries[-1][0] > args.balanced):
                        r = run(args.build, shard, p, m, schedule, args.steps, tmp, v, cpus,
                                args.batch)
                        tries.append((100.0 * (max(r[1]) / min(r[1]) - 1.0), r))
                    imbalance, (b, busy, how, load) = min(tries, key=lambda t: t[0])
                    if len(tries) > 1:
                        how += " (most balanced of %d: %s)" % (
                            len(tries), "/".join("%.1f" % t[0] for t in tries))
                    ideal = 100.0 * (p - 1) / (v * m + p - 1)
                    others = ""
                    if load:
                        others = "; others " + "/".join("%.1f" % x for x in load[0])
                        if max(load[1]) >= 0.1:
                            others += " (steal " + "/".join("%.1f" % x for x in load[1]) + ")"
                    print("%-3d %-4d %-14s %9.1f %11.1f %12.1f-%-5.1f %12.1f %s  %s%s" % (
                        p, m, schedule + (" v=%d" % v if v > 1 else ""), ideal, b[0],
                        min(b[1:]), max(b[1:]), imbalance, how,
                        "/".join("%.0f" % x for x in busy), others), flush=True)


if __name__ == "__main__":
    main()
