#!/usr/bin/python3
"""test_slurm.py — deploy/slurm/distrain.sbatch on a real, one-host Slurm cluster.

    /usr/bin/python3 tests/integration/test_slurm.py --build BUILD_DIR [unittest args]

Starts munged with a generated key, then slurmctld and two slurmd (Debian's slurmctld, slurmd,
slurm-client and munge packages), all in the foreground as children of this test, with a
slurm.conf generated in a temporary directory (SLURM_CONF points every Slurm command at it):
no accounting, proctrack/linuxproc, task/none, state, spool, pid and log files in the
temporary directory, free ports. The two nodes, dtn1 and dtn2, are two slurmd processes on
this host: Slurm's multiple-slurmd mode (`slurmd -N NAME`, each node with its own Port= and
the same NodeHostname/NodeAddr 127.0.0.1), which Debian's build supports. That is simpler than
a network namespace per slurmd, needs nothing but the loopback interface, and still gives the
script what a real cluster gives it: a 2-node allocation, steps started by two slurmds, node
names that are not host names (the agents register as dtn1 and dtn2).

- `sbatch --wait -N 2 distrain.sbatch JOB.yaml` with a tiny CPU job: exit status 0, the job
  COMPLETED on both nodes as dp=2, and its per-step losses (rank 0's metrics, written through
  DISTRAIN_METRICS) equal those of the same spec under `distrainctl run --local --nodes 2`
  (1e-6 relative; they are in fact identical).
- A job that fails (its data file does not exist): sbatch's exit status is 1.
- One node's agent SIGKILLed mid-job: the allocation and the other agent go on, the
  coordinator declares the node dead and restarts the job from its checkpoint on dtn1 alone,
  and the job completes with the reference losses (1e-5 relative, as the chaos suite).
- `scancel --batch --signal=TERM` mid-job (what the script's --signal=B:TERM@120 sends before
  the time limit): the job is stopped with the step its trainers stopped after committed.
- A plain `scancel` mid-job (what a user types, and what preemption does): every step gets
  SIGTERM at once, the coordinator's included, which stays until the trainers have saved: the
  step they stopped after is committed.

Exits 77 (skip) with the reason when the Slurm or munge binaries are missing, when not root
(SlurmUser=root, munged's key), or when a daemon cannot start here. Every daemon, step and
trainer is stopped at the end, also on failure.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_control_plane as cp  # noqa: E402  (data, ports, polling, process helpers)

SRC = cp.SRC
SBATCH = os.path.join(SRC, "deploy", "slurm", "distrain.sbatch")
NODES = ("dtn1", "dtn2")
STEPS = 60
EVERY = 10
CLUSTER = None  # the running Slurm cluster, set by main()


class Skip(Exception):
    pass


def proc_environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return []


class Slurm:
    """munged, slurmctld and one slurmd per node name, in self.tmp."""
    BINARIES = ("munged", "munge", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun",
                "scontrol", "squeue", "scancel", "sinfo")

    def __init__(self):
        missing = [b for b in self.BINARIES
                   if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
        if missing:
            raise Skip("Slurm/munge binaries missing: %s (Debian: slurmctld slurmd slurm-client "
                       "munge, see deploy/install-deps.sh)" % " ".join(missing))
        if os.geteuid() != 0:
            raise Skip("a private Slurm cluster needs root here (SlurmUser=root, munged)")
        self.tmp = tempfile.mkdtemp(prefix="dt-slurm-")
        self.procs = {}
        self.conf = os.path.join(self.tmp, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf, OMP_NUM_THREADS="1",
                        PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        for k in list(self.env):  # an outer allocation must not leak into ours
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]

    def path(self, *p):
        return os.path.join(self.tmp, *p)

    def spawn(self, name, args):
        log = open(self.path("log", name + ".out"), "ab")
        p = subprocess.Popen(cp.DIE_WITH_US + args, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=self.env, cwd=self.tmp)
        log.close()
        self.procs[name] = p
        return p

    def check_alive(self, name):
        p = self.procs[name]
        if p.poll() is not None:
            raise Skip("%s cannot run here (exit %s):\n%s" % (
                name, p.returncode, cp.tail(self.path("log", name + ".out"), 15)))

    def write_conf(self):
        ctld, *ports = [cp.free_port() for _ in range(1 + len(NODES))]
        nodes = "".join(
            "NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d State=UNKNOWN\n"
            % (n, os.uname().nodename, port, os.cpu_count() or 1) for n, port in zip(NODES, ports))
        with open(self.conf, "w") as f:
            f.write(
                "# written by test_slurm.py\n"
                "ClusterName=dttest\nSlurmctldHost=localhost\nSlurmctldPort=%d\n"
                "SlurmUser=root\nSlurmdUser=root\n"
                "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket=%s\n"
                "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
                "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
                "SchedulerType=sched/builtin\nAccountingStorageType=accounting_storage/none\n"
                "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\n"
                "MpiDefault=none\nMailProg=/bin/true\nReturnToService=2\n"
                "StateSaveLocation=%s\nSlurmdSpoolDir=%s\n"
                "SlurmctldPidFile=%s\nSlurmdPidFile=%s\n"
                "SlurmctldLogFile=%s\nSlurmdLogFile=%s\n"
                "SlurmctldDebug=info\nSlurmdDebug=info\nKillWait=5\n"
                "%s"
                "PartitionName=dt Nodes=%s Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=YES\n"
                % (ctld, self.path("munge", "socket"), self.path("state"),
                   self.path("spool", "%n"), self.path("slurmctld.pid"),
                   self.path("slurmd-%n.pid"), self.path("log", "slurmctld.log"),
                   self.path("log", "slurmd-%n.log"), nodes, ",".join(NODES)))

    def start(self):
        t = time.monotonic()
        for d in ["log", "state", "munge"] + [os.path.join("spool", n) for n in NODES]:
            os.makedirs(self.path(d), exist_ok=True)
        os.chmod(self.path("munge"), 0o700)
        key = self.path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.write_conf()
        self.spawn("munged", ["munged", "--foreground", "--force", "--key-file", key,
                              "--socket", self.path("munge", "socket"),
                              "--pid-file", self.path("munge", "munged.pid"),
                              "--log-file", self.path("log", "munged.log"),
                              "--seed-file", self.path("munge", "munged.seed")])
        cp.wait_until(lambda: self.check_alive("munged") or
                      subprocess.run(["munge", "-n", "-S", self.path("munge", "socket")],
                                     capture_output=True).returncode == 0, 15, "munged")
        self.spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        cp.wait_until(lambda: self.check_alive("slurmctld") or self.run(
            "scontrol", "ping", check=False).stdout.find("UP") >= 0, 30, "slurmctld up")
        for n in NODES:
            self.spawn("slurmd-" + n, ["slurmd", "-D", "-N", n, "-f", self.conf])

        def idle():
            for n in NODES:
                self.check_alive("slurmd-" + n)
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            return states.count("idle") == len(NODES)

        cp.wait_until(idle, 30, "both nodes idle (%s)" % self.path("log"), interval=0.2)
        sys.stderr.write("[slurm: munged, slurmctld, slurmd x %d up in %.1f s] "
                         % (len(NODES), time.monotonic() - t))

    def run(self, *args, check=True, timeout=30, env=None):
        return subprocess.run(list(args), capture_output=True, text=True, check=check,
                              timeout=timeout, env=env or self.env, cwd=self.tmp)

    def ours(self):
        """Live processes (steps, agents, trainers) that run with this cluster's SLURM_CONF."""
        mark = ("SLURM_CONF=" + self.conf).encode()
        return [int(d) for d in os.listdir("/proc")
                if d.isdigit() and int(d) != os.getpid() and mark in proc_environ(int(d))]

    def stop(self):
        """Cancels every job, stops the daemons (SIGTERM, SIGKILL after 10 s), kills what is
        left of ours, removes the directory."""
        try:
            ids = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
            if ids:
                self.run("scancel", *ids, check=False, timeout=10)
                cp.wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", check=False,
                                                   timeout=10).stdout.split(), 20, "no jobs")
        except (AssertionError, OSError, subprocess.SubprocessError) as e:
            sys.stderr.write("[cancelling jobs: %s] " % e)
        order = ["slurmd-" + n for n in NODES] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p and p.poll() is None:
                p.terminate()
        for name in order:
            p = self.procs.get(name)
            if not p:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self.ours() + cp.procs_under(self.tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if os.environ.get("DT_KEEP_LOGS"):
            sys.stderr.write("[kept %s] " % self.tmp)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def dump_logs(self):
        for root, _, files in os.walk(self.tmp):
            for f in sorted(files):
                if f.endswith((".log", ".out", ".txt")):
                    p = os.path.join(root, f)
                    sys.stderr.write("\n---- %s (tail) ----\n%s" % (os.path.relpath(p, self.tmp),
                                                                    cp.tail(p, 30)))


def read_metrics(path):
    with open(path) as f:
        return [json.loads(x) for x in f if '"loss"' in x]


class SlurmTest(unittest.TestCase):
    ref = None  # the reference run's metrics, made once

    def setUp(self):
        self.c = CLUSTER
        self.t0 = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix=self._testMethodName + "-", dir=self.c.tmp)
        self.prefix = os.path.join(self.c.tmp, "prefix")
        if not os.path.isdir(self.prefix):  # DISTRAIN_PREFIX: bin/ holding the build's binaries
            os.makedirs(os.path.join(self.prefix, "bin"))
            for sub, name in (("coordinator", "distrain-coordinator"),
                              ("coordinator", "distrainctl"),
                              ("worker/agent", "distrain-worker"),
                              ("worker/trainer", "distrain-train")):
                os.symlink(cp.binary(sub, name), os.path.join(self.prefix, "bin", name))

    def tearDown(self):
        if self._outcome.result.failures or self._outcome.result.errors:
            self.c.dump_logs()
        sys.stderr.write("[%s: %.1f s] " % (self._testMethodName, time.monotonic() - self.t0))

    def spec(self, train=None):
        data_train, val = cp.shared_data()
        path = os.path.join(self.dir, "job.yaml")
        with open(path, "w") as f:
            f.write(
                "# written by test_slurm.py; checkpoint.dir comes with --set\n"
                "name: slurm-tiny\n"
                "model: {layers: 2, heads: 2, channels: 32, vocab: 256, max_seq: 64, "
                "init: \"seed:1\"}\n"
                "data: {train: \"%s\", val: \"%s\"}\n"
                "training: {batch: 4, seq: 32, micro_batch: 2, steps: %d, val_every: 20, "
                "val_batches: 2, threads: 1, sample: 0}\n"
                "optimizer: {lr: 1.0e-3, schedule: constant}\n"
                "checkpoint: {every: %d, keep: 0}\n"
                "elastic: {min_nodes: 1, max_restarts: 3, heartbeat_ms: 200}\n"
                % (train or data_train, val, STEPS, EVERY))
        return path

    def reference(self):
        """The same spec under distrainctl run --local: two agents, dp=2 (what the script
        submits on two nodes). min_nodes=2 as the script waits for every node: else the job
        could start on the first agent as dp=1 and grow at a checkpoint, and distrainctl's
        metrics stream does not show the steps a new generation runs again."""
        if SlurmTest.ref is None:
            d = os.path.join(self.c.tmp, "reference")
            os.makedirs(d)
            spec = self.spec()
            metrics = os.path.join(d, "metrics.jsonl")
            r = subprocess.run(
                [cp.binary("coordinator", "distrainctl"), "run", "--local", "--nodes", "2",
                 "--run-dir", os.path.join(d, "run"), "--metrics", metrics,
                 "--set", "parallel.dp=2", "--set", "elastic.min_nodes=2",
                 "--set", "elastic.max_nodes=2",
                 "--set", "checkpoint.dir=" + os.path.join(d, "ckpt"), spec],
                capture_output=True, text=True, timeout=120, cwd=d,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.assertEqual(r.returncode, 0, "reference run failed:\n" + r.stderr[-3000:])
            SlurmTest.ref = read_metrics(metrics)
            self.assertEqual([m["step"] for m in SlurmTest.ref], list(range(1, STEPS + 1)))
        return SlurmTest.ref

    def sbatch(self, spec, env=None, timeout=90, background=False):
        """sbatch --wait -N 2 distrain.sbatch SPEC; returns (Popen or CompletedProcess, the
        job's output file, the metrics file, the run dir)."""
        out = os.path.join(self.dir, "slurm-%j.out")
        metrics = os.path.join(self.dir, "metrics.jsonl")
        run_dir = os.path.join(self.dir, "run")
        e = dict(self.c.env, DISTRAIN_PREFIX=self.prefix, DISTRAIN_RUN_DIR=run_dir,
                 DISTRAIN_METRICS=metrics, **(env or {}))
        args = ["sbatch", "--wait", "-N", str(len(NODES)), "-o", out, "-D", self.dir, SBATCH,
                spec, "--set", "checkpoint.dir=" + os.path.join(self.dir, "ckpt")]
        if background:
            p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=e, cwd=self.dir)
            return p, metrics, run_dir
        r = subprocess.run(args, capture_output=True, text=True, env=e, cwd=self.dir,
                           timeout=timeout)
        return r, metrics, run_dir

    @staticmethod
    def wait_past_step(p, metrics, step):
        """Waits until the job of sbatch process p has written step to its metrics file."""
        def past():
            if p.poll() is not None:
                raise AssertionError("sbatch ended early: %s" % p.stdout.read())
            try:
                return read_metrics(metrics)[-1]["step"] >= step
            except (OSError, IndexError, ValueError):
                return False

        cp.wait_until(past, 60, "step %d" % step, interval=0.05)

    def job_output(self, sbatch_stdout):
        job = sbatch_stdout.split()[-1] if "Submitted batch job" in sbatch_stdout else "?"
        with open(os.path.join(self.dir, "slurm-%s.out" % job)) as f:
            return f.read()

    def assert_losses(self, got, rel):
        """Every step in got has the reference's loss. (After a restart, the steps run again
        from the checkpoint are not in distrainctl's stream: got has the first run's.)"""
        ref = {m["step"]: m for m in self.reference()}
        self.assertEqual(got[-1]["step"], STEPS, "the job did not reach its last step")
        worst = 0.0
        for m in got:
            r = ref[m["step"]]
            worst = max(worst, abs(m["loss"] - r["loss"]) / abs(r["loss"]))
            self.assertLessEqual(abs(m["loss"] - r["loss"]), rel * abs(r["loss"]),
                                 "step %d: loss %.9g under Slurm, %.9g under run --local"
                                 % (m["step"], m["loss"], r["loss"]))
        sys.stderr.write("[%d steps, largest relative loss difference %.2g] " % (len(got), worst))

    def test_job_completes_on_two_nodes_with_the_local_losses(self):
        r, metrics, run_dir = self.sbatch(self.spec())
        self.assertEqual(r.returncode, 0, "sbatch: %s%s" % (r.stdout, r.stderr))
        out = self.job_output(r.stdout)
        self.assertIn("--set parallel.dp=2 --set elastic.max_nodes=2", out)
        # The placement, from the coordinator's log of every transition: the job's output shows
        # the states that distrainctl's polls see, and a rendezvous can fall between two polls.
        coord_log = cp.read_text(os.path.join(run_dir, "coordinator.log"))
        self.assertRegex(coord_log, r"-> RENDEZVOUS \(generation 1\): world 2 "
                         r"\(pp 1 x dp 2 x cp 1 x tp 1\).* on node-\d,node-\d")
        self.assertRegex(out, r"state: +COMPLETED \(generation 1, 0 restarts\)")
        self.assertRegex(out, r"progress: +step %d/%d" % (STEPS, STEPS))
        for n in NODES:  # an agent per Slurm node, registered under its node name, ran a rank
            log = cp.read_text(os.path.join(run_dir, "worker-%s.log" % n))
            self.assertIn("[worker %s] registered" % n, log)
            self.assertRegex(log, r"started job job-1 generation 1 rank [01]")
            self.assertIn("signal 15: stopping trainers", log, "not stopped through scancel")
        self.assertIn("signal 15: shutting down", cp.read_text(
            os.path.join(run_dir, "coordinator.log")))
        got = read_metrics(metrics)
        self.assertEqual([m["step"] for m in got], list(range(1, STEPS + 1)))
        self.assert_losses(got, 1e-6)

    def test_failed_job_fails_the_batch_job(self):
        r, _, _ = self.sbatch(self.spec(train=os.path.join(self.dir, "missing_*.bin")))
        self.assertEqual(r.returncode, 1, "sbatch: %s%s" % (r.stdout, r.stderr))
        out = self.job_output(r.stdout)
        self.assertRegex(out, r"state: +FAILED")
        self.assertIn("did not complete", out)

    def test_lost_node_recovers_through_distrain(self):
        """dtn2's agent is SIGKILLed at step >= 20: the batch job goes on and completes."""
        spec = self.spec()
        self.reference()
        p, metrics, run_dir = self.sbatch(spec, env={"DISTRAIN_FAULT_SLOW_MS": "60"},
                                          background=True)
        try:
            self.wait_past_step(p, metrics, 2 * EVERY)
            agents = [pid for pid in self.c.ours()
                      if "distrain-worker" in " ".join(proc_cmdline(pid)[:1]) and
                      "dtn2" in proc_cmdline(pid)]
            self.assertEqual(len(agents), 1, "dtn2's agent: %s" % agents)
            os.kill(agents[0], signal.SIGKILL)
            t = time.monotonic()
            out_s, _ = p.communicate(timeout=90)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 0, "sbatch: %s" % out_s)
        out = self.job_output(out_s)
        self.assertRegex(out, r"srun: error: dtn2: task \d+: Killed")
        self.assertRegex(out, r"RUNNING \(generation 2\): its rank is training")
        self.assertRegex(out, r"state: +COMPLETED \(generation 2, 1 restart\)")
        self.assertRegex(out, r"failed node: +node-\d")
        self.assert_losses(read_metrics(metrics), 1e-5)
        sys.stderr.write("[agent killed -> job completed %.1f s later] " % (time.monotonic() - t))

    def test_scancel_batch_stops_the_job_with_its_step_saved(self):
        """`scancel --batch --signal=TERM` (what Slurm sends 120 s before the time limit,
        through the script's --signal) mid-job: the script stops the job as `distrainctl stop`
        does, and the step its trainers stopped after is the newest committed in the
        checkpoint directory."""
        p, metrics, run_dir = self.sbatch(self.spec(), env={"DISTRAIN_FAULT_SLOW_MS": "60"},
                                          background=True)
        try:
            self.wait_past_step(p, metrics, EVERY + EVERY // 2)
            job = self.c.run("squeue", "-h", "-o", "%i").stdout.split()[0]
            self.c.run("scancel", "--batch", "--signal=TERM", job, timeout=10)
            out_s, _ = p.communicate(timeout=90)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertNotEqual(p.returncode, 0, "sbatch: %s" % out_s)
        out = self.job_output(out_s)
        self.assertIn("signalled: stopping job-1", out)
        coord_log = cp.read_text(os.path.join(run_dir, "coordinator.log"))
        self.assertIn("job job-1: RUNNING -> STOPPED (generation 1): stopped by the user",
                      coord_log)
        rank0 = glob.glob(os.path.join(run_dir, "worker-*", "job-1", "rank-0.log"))
        stopped = re.search(r"stopped on request after step (\d+) of %d: its checkpoint is "
                            r"committed" % STEPS, cp.read_text(rank0[0]))
        self.assertTrue(stopped, "rank 0 did not stop with its step saved")
        step = int(stopped.group(1))
        self.assertTrue(EVERY + EVERY // 2 <= step < STEPS, step)
        steps = cp.ClusterTest.committed_steps(os.path.join(self.dir, "ckpt"))
        self.assertEqual(steps[-1], step, steps)
        for n in NODES:
            self.assertIn("saves its step first",
                          cp.read_text(os.path.join(run_dir, "worker-%s.log" % n)))


    def test_plain_scancel_stops_the_job_with_its_step_saved(self):
        """A plain `scancel` mid-job signals every step at once, the coordinator's with the
        agents' and the trainers': the coordinator waits for the leaving nodes' trainers, so the
        step they stopped after is committed, as with `scancel --batch`."""
        p, metrics, run_dir = self.sbatch(self.spec(), env={"DISTRAIN_FAULT_SLOW_MS": "60"},
                                          background=True)
        try:
            self.wait_past_step(p, metrics, EVERY + EVERY // 2)
            job = self.c.run("squeue", "-h", "-o", "%i").stdout.split()[0]
            self.c.run("scancel", job, timeout=10)
            p.communicate(timeout=90)
            cp.wait_until(lambda: not self.c.run("squeue", "-h", "-o", "%i").stdout.strip(), 60,
                          "the Slurm job to end")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        coord_log = cp.read_text(os.path.join(run_dir, "coordinator.log"))
        rank0 = glob.glob(os.path.join(run_dir, "worker-*", "job-1", "rank-0.log"))
        stopped = re.search(r"stopped on request after step (\d+) of %d: its checkpoint is "
                            r"committed" % STEPS, cp.read_text(rank0[0]))
        self.assertTrue(stopped, "rank 0 did not stop with its step saved:\n" +
                        cp.read_text(rank0[0])[-2000:] + coord_log[-3000:])
        step = int(stopped.group(1))
        self.assertTrue(EVERY + EVERY // 2 <= step < STEPS, step)
        steps = cp.ClusterTest.committed_steps(os.path.join(self.dir, "ckpt"))
        self.assertEqual(steps[-1], step, steps)
        self.assertRegex(coord_log, r"signal 15: shutting down once the trainers of leaving "
                         r"or drained nodes have saved their step")


def main():
    global CLUSTER
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the CMake build directory")
    args, rest = ap.parse_known_args()
    cp.BUILD = os.path.abspath(args.build)
    ok = False
    try:
        CLUSTER = Slurm()
        CLUSTER.start()
        prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
        ok = prog.result.wasSuccessful()
    except Skip as e:
        print("SKIP: %s" % e)
        code = 77
    except AssertionError as e:  # the daemons run but the cluster does not come up
        print("FAIL: %s" % e)
        CLUSTER.dump_logs()
        code = 1
    else:
        code = 0 if ok else 1
    finally:
        if CLUSTER:
            CLUSTER.stop()
        if "root" in cp._SHARED:
            shutil.rmtree(cp._SHARED["root"], ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
