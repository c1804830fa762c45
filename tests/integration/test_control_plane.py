#!/usr/bin/python3
"""test_control_plane.py — loopback integration tests of distrain's control plane.

Runs the real binaries (distrain-coordinator, distrain-worker, distrain-train, distrainctl,
distrain-prep) on 127.0.0.1 and talks to the coordinator with a real gRPC client: Python stubs
generated at test time from proto/distrain.proto (protoc + grpc_python_plugin), so the wire
contract is exercised exactly as a third-party client would see it.

    /usr/bin/python3 tests/integration/test_control_plane.py --build BUILD_DIR [unittest args]

Every wait is bounded; every process a test starts (and every trainer its agents start) is
killed in tearDown, and every temporary directory is removed. Needs python3-grpcio,
python3-protobuf, protobuf-compiler (protoc) and protobuf-compiler-grpc (grpc_python_plugin).
"""
import argparse
import glob
import importlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

try:
    import grpc
except ImportError:  # test_gpu_cluster.py's GPU machines: it uses distrainctl, never RPC
    grpc = None

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None  # set by main()
pb = None  # distrain_pb2
pb_grpc = None  # distrain_pb2_grpc
SERVICE = "distrain.v1.Coordinator"
HEARTBEAT_MS = 200


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def binary(sub, name):
    path = os.path.join(BUILD, sub, name)
    if not os.access(path, os.X_OK):
        raise unittest.SkipTest("%s is not built" % path)
    return path


def gen_stubs(out_dir):
    """Compiles proto/distrain.proto into Python modules under out_dir and imports them."""
    global pb, pb_grpc
    plugin = shutil.which("grpc_python_plugin")
    protoc = shutil.which("protoc")
    if grpc is None:
        sys.exit("test_control_plane.py: python3-grpcio is required")
    if not plugin or not protoc:
        sys.exit("test_control_plane.py: protoc and grpc_python_plugin are required "
                 "(packages protobuf-compiler, protobuf-compiler-grpc)")
    subprocess.run([protoc, "-I", os.path.join(SRC, "proto"), "--python_out=" + out_dir,
                    "--grpc_out=" + out_dir, "--plugin=protoc-gen-grpc=" + plugin,
                    os.path.join(SRC, "proto", "distrain.proto")], check=True)
    sys.path.insert(0, out_dir)
    pb = importlib.import_module("distrain_pb2")
    pb_grpc = importlib.import_module("distrain_pb2_grpc")


# A daemon must not outlive a killed test runner: setpriv (util-linux, always present) sets
# PR_SET_PDEATHSIG and execs the daemon, so the pid stays the daemon's. Not preexec_fn: that
# makes Popen fork() instead of vfork(), and gRPC 1.51's fork handlers, which stop and restart
# its thread pools in this process, race with a channel being torn down ("thread_pool.cc:225
# assertion failed", an abort of this test process seen in CI).
DIE_WITH_US = ["setpriv", "--pdeathsig", "KILL", "--"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def proc_state(pid):
    """'R', 'S', 'Z', ... or None when the process does not exist."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2]


def proc_alive(pid):
    s = proc_state(pid)
    return s is not None and s not in ("Z", "X")


def cmdline(pid):
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def proc_ppid(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(")") + 2:].split()[1])


def proc_comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return None


def procs_under(root):
    """Live processes whose working directory is inside root (trainers run in their agent's
    work directory, so this finds every trainer a test's agents started)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cwd = os.readlink("/proc/%s/cwd" % d)
        except OSError:
            continue
        if (cwd == root or cwd.startswith(root + "/")) and proc_alive(int(d)):
            found.append(int(d))
    return found


def wait_until(pred, timeout, what, interval=0.02):
    """Polls pred until it returns something truthy; returns it, or raises AssertionError."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 (grpc.RpcError: the coordinator may be restarting)
            if grpc is None or not isinstance(e, grpc.RpcError):
                raise
            last_exc = e
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %.1f s waiting for %s%s" % (
                timeout, what, " (last error: %s)" % last_exc.details() if last_exc else ""))
        time.sleep(interval)


def read_text(path):
    with open(path) as f:
        return f.read()


def tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return "(no %s)" % path
    return "".join(lines[-n:])


_SHARED = {}


def shared_data():
    """Byte-level token shards (a few hundred KB of generated text), made once with
    distrain-prep and shared by every test."""
    if "data" in _SHARED:
        return _SHARED["data"]
    root = tempfile.mkdtemp(prefix="dt-cp-data-")
    _SHARED["root"] = root
    rng = random.Random(7)
    words = ("the quick brown fox jumps over a lazy dog while seven wise old owls watch "
             "from the tall oak tree near the quiet river bank at dawn").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) for _ in range(5000)]
    text = os.path.join(root, "text.txt")
    with open(text, "w") as f:
        f.write("\n".join(lines) + "\n")
    out = os.path.join(root, "data")
    subprocess.run([binary("worker/trainer", "distrain-prep"), "--input", text, "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
    train, val = os.path.join(out, "train_000000.bin"), os.path.join(out, "val.bin")
    assert os.path.getsize(train) > 200 * 1024, os.path.getsize(train)
    _SHARED["data"] = (train, val)
    return _SHARED["data"]


def slow_steps(seconds):
    """Steps of the SLOW shape that take about `seconds` with this build on this machine
    (sanitizer builds are several times slower): the median step time of 30 standalone steps,
    measured once."""
    if "slow_ms" not in _SHARED:
        train, _ = shared_data()
        s = SLOW
        metrics = os.path.join(_SHARED["root"], "calibrate.jsonl")
        args = [binary("worker/trainer", "distrain-train"), "--train", train, "--quiet",
                "--threads", "1", "--steps", "30", "--metrics", metrics]
        for k in ("layers", "heads", "channels", "vocab", "max_seq", "batch", "seq"):
            args += ["--" + k.replace("_", "-"), str(s[k])]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
        with open(metrics) as f:
            ms = sorted(json.loads(x)["ms"] for x in f if '"ms"' in x)
        _SHARED["slow_ms"] = max(0.5, ms[len(ms) // 2])
    return int(min(20000, max(100, seconds * 1000.0 / _SHARED["slow_ms"])))


# Model shapes: TINY runs a step in ~1 ms (a whole job in well under a second); SLOW takes
# ~8 ms per step on one thread, for jobs that must still be running while the test acts.
TINY = dict(layers=2, heads=2, channels=32, vocab=256, max_seq=64, batch=4, seq=32, micro_batch=4)
SLOW = dict(layers=2, heads=2, channels=64, vocab=256, max_seq=64, batch=8, seq=64, micro_batch=8)


def job_yaml(ckpt_dir, steps, shape=TINY, every=20, val_every=20, name="tiny",
             min_nodes=1, max_nodes=1, max_restarts=3):
    train, val = shared_data()
    s = shape
    return (
        "# written by test_control_plane.py\n"
        "name: %s\n"
        "model: {layers: %d, heads: %d, channels: %d, vocab: %d, max_seq: %d, init: \"seed:1\"}\n"
        "data: {train: \"%s\", val: \"%s\"}\n"
        "training: {batch: %d, seq: %d, micro_batch: %d, steps: %d, val_every: %d, "
        "val_batches: 2, threads: 1, sample: 0}\n"
        "optimizer: {lr: 1.0e-3, schedule: constant}\n"
        "checkpoint: {dir: \"%s\", every: %d, keep: 0}\n"
        "elastic: {min_nodes: %d, max_nodes: %d, max_restarts: %d, heartbeat_ms: %d}\n"
        % (name, s["layers"], s["heads"], s["channels"], s["vocab"], s["max_seq"], train, val,
           s["batch"], s["seq"], s["micro_batch"], steps, val_every, ckpt_dir, every, min_nodes,
           max_nodes, max_restarts, HEARTBEAT_MS))


def job_spec(ckpt_dir, steps, shape=TINY, every=0, name="py", dp=1):
    """The same kind of job as job_yaml, as a JobSpec message with every section present; dp > 1
    splits the global batch over dp ranks on up to dp nodes."""
    train, val = shared_data()
    s = shape
    spec = pb.JobSpec(
        name=name,
        model=pb.ModelSpec(layers=s["layers"], heads=s["heads"], channels=s["channels"],
                           vocab=s["vocab"], max_seq=s["max_seq"], init="seed:1"),
        data=pb.DataSpec(train=train, val=val),
        training=pb.TrainingSpec(batch=s["batch"], seq=s["seq"], steps=steps,
                                 micro_batch=s["micro_batch"], val_every=0, val_batches=2,
                                 threads=1, sample=0),
        optimizer=pb.OptimizerSpec(lr=1e-3, warmup=0, schedule="constant", min_lr_frac=0.0,
                                   weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                                   grad_clip=1.0),
        parallel=pb.ParallelSpec(dp=1, tp=1, pp=1, cp=1, zero_stage=0, schedule="1f1b"),
        checkpoint=pb.CheckpointSpec(dir=ckpt_dir, every=every, keep=0),
        elastic=pb.ElasticSpec(min_nodes=1, max_nodes=1, max_restarts=3,
                               heartbeat_ms=HEARTBEAT_MS))
    if dp > 1:
        spec.parallel.dp = dp
        spec.training.micro_batch = shape["batch"] // dp
        spec.elastic.max_nodes = dp
    return spec


# ---------------------------------------------------------------------------------------------
# A loopback cluster: one coordinator, agents, and a Python client
# ---------------------------------------------------------------------------------------------

class ClusterTest(unittest.TestCase):
    """Base class: a temp dir, process bookkeeping, a coordinator and agents on loopback."""

    def setUp(self):
        self.t0 = time.monotonic()
        self.tmp = tempfile.mkdtemp(prefix="dt-cp-")
        self.procs = []  # every Popen this test started
        self.channels = []
        self.coord = None
        self.port = None
        self.agents = {}  # hostname -> Popen
        self.token_file = os.path.join(self.tmp, "token")
        self.token = "%032x" % random.getrandbits(128)
        with open(self.token_file, "w") as f:
            f.write(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", DISTRAIN_DEBUG="info")

    def tearDown(self):
        for ch in self.channels:
            ch.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Trainers our agents started (they die with their agent; this is a safety net).
        leftovers = procs_under(self.tmp)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self._failed() or os.environ.get("DT_KEEP_LOGS"):
            self._dump_logs()
        shutil.rmtree(self.tmp, ignore_errors=True)
        sys.stderr.write("[%s: %.1f s] " % (self._testMethodName, time.monotonic() - self.t0))

    def _failed(self):
        outcome = getattr(self, "_outcome", None)
        result = getattr(outcome, "result", None)
        if result is None:
            return False
        for test, _ in list(result.failures) + list(result.errors):
            if test is self:
                return True
        return not getattr(outcome, "success", True)

    def _dump_logs(self):
        for path in sorted(glob.glob(os.path.join(self.tmp, "**", "*.log"), recursive=True)):
            sys.stderr.write("\n---- %s (tail) ----\n%s" % (os.path.relpath(path, self.tmp),
                                                            tail(path)))

    # -- processes --------------------------------------------------------------------------

    def spawn(self, args, log, netns=None, **kw):
        """netns: run it in that network namespace."""
        logf = open(os.path.join(self.tmp, log), "ab")
        inside = ["ip", "netns", "exec", netns] if netns else []
        p = subprocess.Popen(DIE_WITH_US + inside + args, stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=kw.pop("env", self.env),
                             cwd=kw.pop("cwd", self.tmp), **kw)
        logf.close()
        self.procs.append(p)
        return p

    def start_coordinator(self, port=0, heartbeat_ms=HEARTBEAT_MS, env=None, max_files=None,
                          host="127.0.0.1", netns=None, args=()):
        """max_files: soft and hard open-files limit of the coordinator (it cannot raise it).
        host: the address it listens on, and this test reaches it at. args: more flags."""
        port_file = os.path.join(self.tmp, "coord.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
                 ) if max_files else None
        self.coord = self.spawn(
            [binary("coordinator", "distrain-coordinator"), "--listen", "%s:%d" % (host, port),
             "--port-file", port_file, "--state-dir", os.path.join(self.tmp, "state"),
             "--token-file", self.token_file, "--heartbeat-ms", str(heartbeat_ms)] + list(args),
            "coordinator.log", env=dict(self.env, **(env or {})), preexec_fn=limit, netns=netns)

        def port_written():
            if self.coord.poll() is not None:
                raise AssertionError("the coordinator exited with %s:\n%s" % (
                    self.coord.returncode, tail(os.path.join(self.tmp, "coordinator.log"))))
            try:
                with open(port_file) as f:
                    return int(f.read().strip() or 0)
            except (OSError, ValueError):
                return 0

        self.port = wait_until(port_written, 10, "the coordinator's port file")
        # Fresh channels from here on. gRPC Python shares subchannels between channels with the
        # same arguments, and a subchannel still holding the killed coordinator's connection
        # (noticed only when polled) would first report READY, then IDLE, and not reconnect.
        for ch in self.channels:
            ch.close()
        self.channels = []
        self._starts = getattr(self, "_starts", 0) + 1
        self._stub = None
        if port:
            self.assertEqual(self.port, port)
        self.addr = "%s:%d" % (host, self.port)
        return self.coord

    def start_agent(self, host, grace_ms=5000, env=None, token_file=None, coordinator=None,
                    netns=None, args=()):
        work = os.path.join(self.tmp, "work-" + host)
        p = self.spawn([binary("worker/agent", "distrain-worker"), "--coordinator",
                        coordinator or self.addr,
                        "--token-file", token_file or self.token_file, "--cpu-devices", "1", "--hostname", host,
                        "--work-dir", work, "--grace-ms", str(grace_ms),
                        "--trainer", binary("worker/trainer", "distrain-train")] + list(args),
                       "agent-%s.log" % host, env=dict(self.env, **(env or {})), netns=netns)
        self.agents[host] = p
        return p

    def ctl(self, *args, timeout=60, env=None):
        """Runs distrainctl; returns the CompletedProcess (text)."""
        return subprocess.run([binary("coordinator", "distrainctl")] + list(args),
                              capture_output=True, text=True, env=env or self.env, cwd=self.tmp,
                              timeout=timeout)

    # -- RPC --------------------------------------------------------------------------------

    def stub(self):
        ch = grpc.insecure_channel(self.addr, options=[("dt.coordinator_start", self._starts)])
        self.channels.append(ch)
        grpc.channel_ready_future(ch).result(timeout=10)
        return pb_grpc.CoordinatorStub(ch), ch

    def auth(self, token=None):
        return (("authorization", "Bearer " + (token or self.token)),)

    def call(self, method, req, timeout=5.0, token=None):
        if getattr(self, "_stub", None) is None:
            self._stub, _ = self.stub()
        return getattr(self._stub, method)(req, metadata=self.auth(token), timeout=timeout,
                                           wait_for_ready=True)

    def get_job(self, job_id):
        return self.call("GetJob", pb.GetJobRequest(job_id=job_id))

    def job_now(self, job_id):
        """GetJob, or None while the coordinator is down."""
        try:
            return self.get_job(job_id)
        except grpc.RpcError:
            self._stub = None
            return None

    def nodes(self):
        return list(self.call("ListNodes", pb.ListNodesRequest()).nodes)

    def wait_nodes(self, n, timeout=15):
        return wait_until(
            lambda: len([x for x in self.nodes() if x.state == pb.NODE_ALIVE]) >= n, timeout,
            "%d alive nodes" % n)

    def wait_state(self, job_id, states, timeout, min_step=0):
        names = [pb.JobState.Name(s) for s in states]

        def check():
            j = self.get_job(job_id)
            if j.state in (pb.JOB_FAILED,) and pb.JOB_FAILED not in states:
                raise AssertionError("job %s FAILED: %s" % (job_id, j.reason))
            return j if j.state in states and j.step >= min_step else None

        return wait_until(check, timeout, "job %s in %s (step >= %d)" % (job_id, names, min_step))

    @staticmethod
    def committed_steps(ckpt):
        """The steps with a MANIFEST under checkpoint directory ckpt."""
        if not os.path.isdir(ckpt):
            return []
        return sorted(int(d[5:]) for d in os.listdir(ckpt) if d.startswith("step-") and
                      os.path.exists(os.path.join(ckpt, d, "MANIFEST")))

    def assertUninterrupted(self, job_id, steps, world, skipped=()):
        """Rank 0's step metrics of the job: every step once, but those skipped, each loss the
        uninterrupted run's bit for bit (the same processes, resumed from a checkpoint: no step
        was trained twice, and none differently)."""
        metrics = self.call("GetJobMetrics", pb.GetJobMetricsRequest(job_id=job_id)).metrics
        self.assertEqual([m.step for m in metrics],
                         [s for s in range(1, steps + 1) if s not in skipped])
        extra = ["--skip-steps", ",".join(map(str, skipped))] if skipped else []
        ref = uninterrupted_losses(self.tmp, job_id, world, extra)
        for s in skipped:
            self.assertNotIn(s, ref)
        for m in metrics:
            f32 = struct.unpack("f", struct.pack("f", ref[m.step]))[0]
            self.assertEqual(m.loss, f32, "step %d" % m.step)

    def trainer_of(self, job_id, generation=None):
        """(node, TrainerStatus) of the job's RUNNING trainer with a pid, else None."""
        for n in self.nodes():
            for t in n.trainers:
                if (t.job_id == job_id and t.state == pb.TRAINER_RUNNING and t.pid > 0 and
                        (generation is None or t.generation == generation)):
                    return n, t
        return None

    def submit_yaml(self, text, name="job.yaml"):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(text)
        r = self.ctl("submit", "--coordinator", self.addr, "--token-file", self.token_file, path)
        self.assertEqual(r.returncode, 0, "distrainctl submit failed: %s" % r.stderr)
        job_id = r.stdout.strip()
        self.assertRegex(job_id, r"^job-\d+$")
        return job_id

    def assertCode(self, ctx, code):
        self.assertEqual(ctx.exception.code(), code,
                         "expected %s, got %s: %s" % (code, ctx.exception.code(),
                                                      ctx.exception.details()))


# ---------------------------------------------------------------------------------------------
# 0. Every program's --help
# ---------------------------------------------------------------------------------------------

class T0_Help(unittest.TestCase):
    # (the source with the program's getopt_long table, the binary, its arguments)
    PROGRAMS = [("coordinator/distrainctl.c", "coordinator", "distrainctl", []),
                ("coordinator/ctl_plan.c", "coordinator", "distrainctl", ["plan"]),
                ("coordinator/main.c", "coordinator", "distrain-coordinator", []),
                ("worker/agent/main.c", "worker/agent", "distrain-worker", []),
                ("worker/trainer/args.c", "worker/trainer", "distrain-train", [])]

    def test_help(self):
        """--help exits 0, fits 100 columns, and names every long option the program's parser
        accepts (read from its getopt_long table), so none is undocumented."""
        for src, sub, name, args in self.PROGRAMS:
            with self.subTest(" ".join([name] + args)):
                with open(os.path.join(SRC, src)) as f:
                    text = f.read()
                if "DT_RPC_TLS_OPTIONS" in text:  # the TLS options' table entries
                    with open(os.path.join(SRC, "common", "rpc.h")) as f:
                        text += f.read()
                opts = set(re.findall(r'"([a-z0-9-]+)",\s*(?:required|no|optional)_argument',
                                      text)) - {"help"}
                self.assertTrue(opts, src)
                p = subprocess.run([binary(sub, name)] + args + ["--help"], capture_output=True,
                                   text=True, timeout=30)
                self.assertEqual(p.returncode, 0, p.stderr)
                out = p.stdout + p.stderr
                for line in out.splitlines():
                    self.assertLessEqual(len(line), 100, line)
                self.assertEqual([o for o in sorted(opts) if "--" + o not in out], [])

    def test_distrainctl_number_flags(self):
        """A bad number names its flag (given as "--flag VALUE", not only "--flag=VALUE") and
        the range; a rank of a world larger than a local cluster is taken."""
        ctl = binary("coordinator", "distrainctl")
        for args, want in ((["run", "--local", "--nodes", "0", "j.yaml"],
                            "distrainctl: --nodes: expected an integer in 1..4096, got '0'"),
                           (["run", "--local", "--devices-per-node=5000", "j.yaml"],
                            "distrainctl: --devices-per-node: expected an integer in 1..4096, "
                            "got '5000'"),
                           (["logs", "job-1", "--rank", "-1"],
                            "distrainctl: --rank: expected an integer in 0..1048575, got '-1'"),
                           (["drain", "node-1", "--wait", "--timeout", "-1"],
                            "distrainctl: --timeout: expected seconds >= 0, got '-1'"),
                           (["drain", "node-1", "--timeout", "5"],
                            "distrainctl drain: --timeout is for drain --wait")):
            p = subprocess.run([ctl] + args, capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(want, p.stderr)
        p = subprocess.run([ctl, "logs", "job-1", "--rank", "5000", "--coordinator", "127.0.0.1:1",
                            "--token-file", os.devnull], capture_output=True, text=True, timeout=30)
        self.assertNotIn("expected an integer", p.stderr)


# ---------------------------------------------------------------------------------------------
# 1. The gRPC surface, from a Python client
# ---------------------------------------------------------------------------------------------

class T1_GrpcSurface(ClusterTest):
    def test_auth_unknown_method_validation_and_pending_job(self):
        self.start_coordinator()
        stub, ch = self.stub()
        # No token, a wrong token: UNAUTHENTICATED, and the call has no effect.
        with self.assertRaises(grpc.RpcError) as cm:
            stub.ListJobs(pb.ListJobsRequest(), timeout=5)
        self.assertCode(cm, grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as cm:
            stub.ListJobs(pb.ListJobsRequest(), metadata=self.auth("not-the-token"), timeout=5)
        self.assertCode(cm, grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as cm:
            stub.SubmitJob(pb.SubmitJobRequest(spec=job_spec("/tmp/x", 5)),
                           metadata=self.auth(self.token + "x"), timeout=5)
        self.assertCode(cm, grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(grpc.RpcError) as cm:  # a prefix of the token is not the token
            stub.ListJobs(pb.ListJobsRequest(), metadata=self.auth(self.token[:-1]), timeout=5)
        self.assertCode(cm, grpc.StatusCode.UNAUTHENTICATED)
        self.assertEqual(len(self.call("ListJobs", pb.ListJobsRequest()).jobs), 0,
                         "an unauthenticated SubmitJob created a job")

        # An unknown method: UNIMPLEMENTED, promptly (not after a deadline).
        for path in ("/%s/Nope" % SERVICE, "/other.Service/Frob"):
            nope = ch.unary_unary(path)
            t = time.monotonic()
            with self.assertRaises(grpc.RpcError) as cm:
                nope(b"\x0a\x03abc", metadata=self.auth(), timeout=10)
            took = time.monotonic() - t
            self.assertCode(cm, grpc.StatusCode.UNIMPLEMENTED)
            self.assertLess(took, 2.0, "UNIMPLEMENTED for %s took %.2f s" % (path, took))

        # A string that is not UTF-8 (a raw RegisterWorker; Python's protobuf cannot make one):
        # INVALID_ARGUMENT naming the field. Stored, it would reach every client in ListNodes,
        # which the official protobuf libraries (this test's) then refuse to decode.
        register = ch.unary_unary("/%s/RegisterWorker" % SERVICE)  # bytes in, bytes out
        info = b"\x0a\x04caf\xe9" + b"\x12\x05\x0a\x03cpu"  # hostname, a device of kind cpu
        with self.assertRaises(grpc.RpcError) as cm:
            register(b"\x0a" + bytes([len(info)]) + info, metadata=self.auth(), timeout=5)
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("RegisterWorker: distrain.v1.NodeInfo.hostname is not UTF-8",
                      cm.exception.details())
        self.assertEqual(self.nodes(), [])
        r = subprocess.run([binary("worker/agent", "distrain-worker"), "--coordinator", self.addr,
                            "--token-file", self.token_file, "--work-dir",
                            os.path.join(self.tmp, "w"), "--hostname", b"caf\xe9"],
                           capture_output=True, text=True, timeout=30, env=self.env)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("the host name is not UTF-8; name the node with --hostname", r.stderr)

        # Invalid specs: INVALID_ARGUMENT naming every violated rule.
        bad = job_spec("/tmp/x", 5)
        bad.model.heads = 3  # channels 32 % 3 != 0
        bad.training.batch = 6  # 6 % (micro_batch 4 x dp 1) != 0
        with self.assertRaises(grpc.RpcError) as cm:
            self.call("SubmitJob", pb.SubmitJobRequest(spec=bad))
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT)
        msg = cm.exception.details()
        self.assertIn("model.channels (32) must be divisible by model.heads (3)", msg)
        self.assertIn("training.batch (6) must be divisible by training.micro_batch (4)", msg)
        missing = job_spec("/tmp/x", 5)
        missing.ClearField("elastic")
        with self.assertRaises(grpc.RpcError) as cm:
            self.call("SubmitJob", pb.SubmitJobRequest(spec=missing))
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT)
        uneven = job_spec("/tmp/x", 5)
        uneven.parallel.cp = 3  # context parallelism splits the sequence: 3 must divide it
        with self.assertRaises(grpc.RpcError) as cm:
            self.call("SubmitJob", pb.SubmitJobRequest(spec=uneven))
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("must be divisible by 2 x parallel.cp (3)", cm.exception.details())
        self.assertEqual(len(self.call("ListJobs", pb.ListJobsRequest()).jobs), 0,
                         "a refused spec created a job")

        # A valid job: stored as submitted, PENDING with a reason while there are no nodes.
        spec = job_spec(os.path.join(self.tmp, "ckpt"), 7, name="from-python")
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.assertRegex(job_id, r"^job-\d+$")
        j = self.get_job(job_id)
        self.assertEqual(j.job_id, job_id)
        self.assertEqual(j.state, pb.JOB_PENDING, pb.JobState.Name(j.state))
        self.assertIn("waiting for nodes", j.reason)
        self.assertIn("min_nodes 1", j.reason)
        self.assertEqual(j.spec, spec)
        self.assertEqual(j.generation, 0)
        self.assertGreater(j.created_ms, 0)
        jobs = self.call("ListJobs", pb.ListJobsRequest()).jobs
        self.assertEqual([x.job_id for x in jobs], [job_id])
        self.assertEqual(jobs[0].state, pb.JOB_PENDING)
        with self.assertRaises(grpc.RpcError) as cm:
            self.call("GetJob", pb.GetJobRequest(job_id="job-999"))
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND)
        # distrainctl reads the same job through its C client
        r = self.ctl("status", job_id, "--json", "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        st = json.loads(r.stdout)
        self.assertEqual((st["job_id"], st["state"], st["name"]), (job_id, "PENDING", "from-python"))

        # status --watch prints a waiting job's reason each time it changes, not only its
        # state: a job that can never start says why, instead of nothing.
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))
        spec.elastic.min_nodes = spec.elastic.max_nodes = 2
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        watch = subprocess.Popen([binary("coordinator", "distrainctl"), "status", job_id, "--watch",
                                  "--coordinator", self.addr, "--token-file", self.token_file],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=self.env, cwd=self.tmp)
        try:
            first = watch.stderr.readline()  # its first poll: no nodes yet
            self.assertEqual(first, "[%s] PENDING (generation 0): waiting for nodes: 0 idle, "
                             "min_nodes 2\n" % job_id)
            info = pb.NodeInfo(hostname="fake0", devices=[pb.Device(kind="cpu", name="cpu")])
            self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info))
            # The reason is the scheduler's, whose pass the registration queues on the
            # coordinator's loop after its reply: a GetJob can come first (seen on a loaded CI
            # machine), so the test waits for it.
            wait_until(lambda: "1 idle" in self.get_job(job_id).reason, 10,
                       "the reason to count the registered node")
            time.sleep(1.0)  # a few of the watch's polls
            self.call("StopJob", pb.StopJobRequest(job_id=job_id))
            _, err = watch.communicate(timeout=30)
        finally:
            watch.kill()
        self.assertEqual(watch.returncode, 1, err)  # the job ended STOPPED
        self.assertIn("[%s] PENDING (generation 0): waiting for nodes: 1 idle, min_nodes 2"
                      % job_id, err)


# ---------------------------------------------------------------------------------------------
# 2. Garbage on the port
# ---------------------------------------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(ftype, flags, stream, payload, claimed_len=None):
    n = len(payload) if claimed_len is None else claimed_len
    return struct.pack(">I", n)[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


class T2_Garbage(ClusterTest):
    def _blast(self, data, rst=False, read=False):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        try:
            if data:
                s.sendall(data)
            if read:
                try:
                    s.recv(4096)
                except (socket.timeout, OSError):
                    pass
        except OSError:
            pass  # the server may close on us first: that is fine
        finally:
            if rst:  # close with RST instead of FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()

    def test_state_dir_lock_and_token_permissions(self):
        """A second coordinator on the same state directory refuses to start, naming the first
        one's pid (two would hand out the same job ids); the first one is unharmed. A token
        file others can read is refused by the coordinator and the agent."""
        self.start_coordinator()
        second = subprocess.run(
            [binary("coordinator", "distrain-coordinator"), "--listen", "127.0.0.1:0",
             "--state-dir", os.path.join(self.tmp, "state"), "--token-file", self.token_file],
            capture_output=True, text=True, timeout=30, env=self.env)
        self.assertNotEqual(second.returncode, 0)
        self.assertIn("the state directory is in use by another coordinator", second.stderr)
        self.assertIn("that coordinator's pid: %d" % self.coord.pid, second.stderr)
        self.call("ListNodes", pb.ListNodesRequest())
        # Its open-files limit: raised from a soft limit of 256 to the hard limit.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        low = subprocess.Popen(
            [binary("coordinator", "distrain-coordinator"), "--listen", "127.0.0.1:0",
             "--state-dir", os.path.join(self.tmp, "state3"), "--token-file", self.token_file],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
        self.procs.append(low)
        line = low.stderr.readline()
        while line and "open files limit" not in line and "listening on port" not in line:
            line = low.stderr.readline()
        self.assertIn("open files limit raised from 256 to %d" % hard, line)
        with open("/proc/%d/limits" % low.pid) as f:
            self.assertEqual(int(re.search(r"Max open files\s+(\d+)", f.read()).group(1)), hard)
        low.kill()
        os.chmod(self.token_file, 0o644)
        for cmd in ([binary("coordinator", "distrain-coordinator"), "--listen", "127.0.0.1:0",
                     "--state-dir", os.path.join(self.tmp, "state2"), "--token-file",
                     self.token_file],
                    [binary("worker/agent", "distrain-worker"), "--coordinator",
                     "127.0.0.1:%d" % self.port, "--token-file", self.token_file, "--work-dir",
                     os.path.join(self.tmp, "w"), "--hostname", "x"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=self.env)
            self.assertNotEqual(r.returncode, 0, cmd[0])
            self.assertIn("token file is accessible by group or others (mode 0644)", r.stderr)

    def test_listener_survives_running_out_of_files(self):
        """At its open-files limit (soft = hard = 128 here, so raising it cannot help) accept
        fails with EMFILE; the coordinator backs off and keeps accepting, and serves calls again
        once the extra connections are gone (gRPC's own listener stopped for good: every later
        call timed out while the process stayed alive). Connections that never finish their
        HTTP/2 preface, or go idle, are closed after DISTRAIN_RPC_IDLE_MS."""
        self.start_coordinator(env={"DISTRAIN_RPC_IDLE_MS": "1500"}, max_files=128)
        self.call("ListNodes", pb.ListNodesRequest())
        flood = [socket.create_connection(("127.0.0.1", self.port), timeout=2) for _ in range(300)]
        log = os.path.join(self.tmp, "coordinator.log")
        wait_until(lambda: "Too many open files" in read_text(log), 10, "an accept failure")
        for s in flood:
            s.close()
        t = time.monotonic()
        fresh = grpc.insecure_channel(self.addr, options=[("dt.fresh", 1)])  # a new connection
        self.channels.append(fresh)
        self.assertEqual(len(pb_grpc.CoordinatorStub(fresh).ListNodes(
            pb.ListNodesRequest(), metadata=self.auth(), timeout=10, wait_for_ready=True).nodes), 0)
        sys.stderr.write("[served again %.2f s after the flood closed] " % (time.monotonic() - t))
        text = read_text(log)
        self.assertIn("cannot accept connections: Too many open files", text)
        self.assertIn("accepting connections again", text)
        # A connection that sent half a preface and one that finished it, then stayed silent:
        # the coordinator closes both (recv sees EOF) once they have been idle for 1.5 s.
        half = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        half.sendall(PREFACE[:10])
        full = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        full.sendall(PREFACE + h2_frame(0x4, 0, 0, b""))
        t = time.monotonic()
        for s in (half, full):
            try:
                while s.recv(4096):  # the server's SETTINGS and GOAWAY frames, then EOF
                    pass
            except ConnectionResetError:
                pass
            s.close()
        self.assertLess(time.monotonic() - t, 8)
        self.assertIsNone(self.coord.poll())

    def test_wrong_token_agent_backs_off(self):
        """An agent with the wrong token retries after 1, 2, 4, ... s (not every second
        forever), and the coordinator warns about rejected calls once per 10 s, not per call."""
        self.start_coordinator()
        bad = os.path.join(self.tmp, "bad-token")
        with open(bad, "w") as f:
            f.write("0" * 32 + "\n")
        os.chmod(bad, 0o600)
        self.start_agent("h0", token_file=bad)
        time.sleep(7.5)  # attempts at 0, 1, 3, 7 s (every second before: 8)
        with open(os.path.join(self.tmp, "agent-h0.log")) as f:
            refused = re.findall(r"refused our token .*retrying in (\d+) s", f.read())
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            warned = re.findall(r"rejected RegisterWorker call without a valid bearer token",
                                f.read())
        self.assertIn(len(refused), (3, 4), refused)
        self.assertEqual(refused[:3], ["1", "2", "4"])
        self.assertEqual(len(warned), 1)
        self.assertEqual(self.nodes(), [])

    def test_unauthenticated_bodies_are_not_buffered(self):
        """16 concurrent calls with a wrong token, each carrying a 32 MiB request: the token is
        checked before the message is read, so every call is refused UNAUTHENTICATED and the
        coordinator's peak RSS grows by far less than the 512 MiB sent (it buffered them all
        before: 16 such calls took it to 384 MB)."""
        self.start_coordinator()

        def hwm_kib():
            with open("/proc/%d/status" % self.coord.pid) as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))

        stub, _ = self.stub()
        before = hwm_kib()
        req = pb.KvPutRequest(job_id="job-1", generation=1, key="k", value=b"\0" * (32 << 20))
        futures = [stub.KvPut.future(req, metadata=self.auth("x" * 32), timeout=30)
                   for _ in range(16)]
        for f in futures:
            with self.assertRaises(grpc.RpcError) as ctx:
                f.result()
            self.assertCode(ctx, grpc.StatusCode.UNAUTHENTICATED)
        grown_mib = (hwm_kib() - before) / 1024.0
        sys.stderr.write("[peak RSS +%.1f MiB for 512 MiB of unauthenticated bodies] " % grown_mib)
        self.assertLess(grown_mib, 16)
        self.call("ListJobs", pb.ListJobsRequest())  # still serving

    def test_garbage_does_not_hurt_the_coordinator(self):
        self.start_coordinator()
        rng = random.Random(1234)
        settings = h2_frame(0x4, 0, 0, struct.pack(">HI", 0x3, 100))  # MAX_CONCURRENT_STREAMS
        headers_payload = bytes([0x82, 0x86, 0x84, 0x41, 0x0f]) + b"127.0.0.1:1234"
        cases = []
        # (a) random bytes, short and long
        for _ in range(40):
            cases.append((os.urandom(rng.choice([1, 7, 24, 100, 4096, 65536])), False, False))
        # (b) a valid preface, then truncated or malformed frames
        for _ in range(10):
            cases += [
                (PREFACE + settings[:rng.randint(1, len(settings) - 1)], False, False),
                (PREFACE + h2_frame(0x4, 0, 0, b"\x00\x03", claimed_len=18), False, False),
                (PREFACE + settings + h2_frame(0x1, 0x4, 1, headers_payload[:3],
                                               claimed_len=len(headers_payload)), False, True),
                (PREFACE + settings + h2_frame(0x1, 0x4, 1, os.urandom(40)), False, True),  # bad HPACK
                (PREFACE + settings + h2_frame(0x1, 0x5, 2, headers_payload), False, True),  # even stream
                (PREFACE + settings + h2_frame(0x0, 0x1, 1, b"\x00\x00\x00\x00\x10xx"), False, True),
                (PREFACE + h2_frame(0x4, 0, 0, b"", claimed_len=0xFFFFFF), False, False),
                (PREFACE + settings + h2_frame(0x8, 0, 0, b"\x7f\xff\xff\xff"), False, True),
                (PREFACE + os.urandom(300), False, True),
                (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False, True),
            ]
        # (c) connections closed (FIN or RST) mid-preface and mid-frame
        for _ in range(20):
            cases += [
                (PREFACE[:rng.randint(1, len(PREFACE) - 1)], rng.random() < 0.5, False),
                (PREFACE + settings + h2_frame(0x1, 0x4, 1, headers_payload)[:rng.randint(1, 8)],
                 rng.random() < 0.5, False),
                (b"", True, False),
            ]
        cases = cases * 3  # every kind, many times
        rng.shuffle(cases)
        # Slow clients: connections that sent half a preface and stay open meanwhile.
        idle = []
        for _ in range(16):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            s.sendall(PREFACE[:10])
            idle.append(s)
        try:
            t = time.monotonic()
            for data, rst, read in cases:
                self._blast(data, rst=rst, read=read)
            blast_s = time.monotonic() - t
            self.assertIsNone(self.coord.poll(), "the coordinator died:\n" +
                              tail(os.path.join(self.tmp, "coordinator.log")))
            # While the slow connections are still open, a normal call is served promptly.
            t = time.monotonic()
            jobs = self.call("ListJobs", pb.ListJobsRequest(), timeout=5)
            self.assertLess(time.monotonic() - t, 2.0)
            self.assertEqual(len(jobs.jobs), 0)
        finally:
            for s in idle:
                s.close()
        # And the coordinator still does real work afterwards.
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(
            spec=job_spec(os.path.join(self.tmp, "ck"), 3))).job_id
        self.assertEqual(self.get_job(job_id).state, pb.JOB_PENDING)
        time.sleep(0.2)
        self.assertIsNone(self.coord.poll(), "the coordinator died")
        sys.stderr.write("[%d garbage connections in %.1f s] " % (len(cases), blast_s))


# ---------------------------------------------------------------------------------------------
# 3. End to end through distrainctl run --local
# ---------------------------------------------------------------------------------------------

class T3_RunLocal(ClusterTest):
    def test_run_local_end_to_end(self):
        steps = 40
        ckpt = os.path.join(self.tmp, "ckpt")
        run_dir = os.path.join(self.tmp, "run")
        metrics = os.path.join(self.tmp, "metrics.jsonl")
        job = os.path.join(self.tmp, "job.yaml")
        # a multiple-choice eval (data.eval, a path relative to the job file) every 20 steps
        hs = os.path.join(self.tmp, "hs.jsonl")
        with open(hs, "w") as f:
            for i in range(6):
                f.write(json.dumps({"ctx": "In the beginning %d" % i, "label": i % 2,
                                    "endings": ["God created", "xq zz %d" % i]}) + "\n")
        subprocess.run([binary("worker/trainer", "distrain-prep"), "--hellaswag", hs, "--out",
                        self.tmp], check=True, capture_output=True)
        # and a named validation set (data.val_sets, its path relative too): data.val's copy
        shutil.copy(shared_data()[1], os.path.join(self.tmp, "val_copy.bin"))
        # training on a blend (data.train) of a named source (relative) and an unnamed one
        train = shared_data()[0]
        shutil.copy(train, os.path.join(self.tmp, "train_copy.bin"))
        with open(job, "w") as f:
            f.write(job_yaml(ckpt, steps, every=20, val_every=20).replace(
                "}\ntraining: {", ", eval: \"hs.bin\", val_sets: \"copy=val_copy.bin\"}\n"
                "training: {eval_every: 20, ").replace(
                'train: "%s"' % train, 'train: "3:web=train_copy.bin,1:%s"' % train))
        # Polls 2 s apart: the last one sees the job COMPLETED and its last steps at once.
        r = self.ctl("run", "--local", "--run-dir", run_dir, "--metrics", metrics, job,
                     timeout=120, env=dict(self.env, DISTRAIN_CTL_POLL_MS="2000"))
        self.assertEqual(r.returncode, 0, "distrainctl run failed (%d):\n%s\n%s" % (
            r.returncode, r.stderr[-3000:], tail(os.path.join(run_dir, "coordinator.log"))))
        # The job's end is said after its last step, not before.
        out = r.stderr.splitlines()
        done = [i for i, x in enumerate(out) if "COMPLETED" in x]
        last = [i for i, x in enumerate(out) if x.startswith("step %6d/%d" % (steps, steps))]
        self.assertTrue(done and last and done[-1] > last[-1], r.stderr[-3000:])
        self.assertTrue(any(re.search(r"^step +20/%d \| .*\| eval acc_norm 0\.\d{4} \|" % steps, x)
                            for x in out), r.stderr[-3000:])
        val20 = [re.search(r"^step +20/%d \| loss [0-9.]+ \(web [0-9.]+, src2 [0-9.]+\) \| "
                           r"val ([0-9.]+) \(copy ([0-9.]+)\) \|" % steps, x) for x in out]
        val20 = [m.groups() for m in val20 if m]
        self.assertEqual(len(val20), 1, r.stderr[-3000:])
        self.assertEqual(val20[0][0], val20[0][1])
        # one JSON object per step, steps 1..N, validation at 20 and 40; before them step 0,
        # the validation and evaluation before training, as the line distrainctl printed
        with open(metrics) as f:
            lines = f.read().splitlines()
        ms = [json.loads(x) for x in lines]
        self.assertEqual([m["step"] for m in ms], list(range(0, steps + 1)))
        m0, ms = ms[0], ms[1:]
        self.assertEqual(sorted(m0), ["eval_acc", "eval_acc_norm", "step", "val_loss", "val_sets"])
        self.assertEqual(m0["val_sets"], {"copy": m0["val_loss"]})
        self.assertGreater(m0["val_loss"], ms[19]["val_loss"])  # it fell by step 20
        self.assertIn("step      0/%d | val %.4f (copy %.4f) | eval acc_norm %.4f (before "
                      "training)" % (steps, m0["val_loss"], m0["val_loss"], m0["eval_acc_norm"]),
                      out)
        for m in ms:
            for k in ("loss", "lr", "grad_norm", "ms", "tokens_per_s"):
                self.assertIsInstance(m[k], (int, float), (k, m))
            self.assertTrue(0 < m["loss"] < 10, m)
            self.assertEqual("val_loss" in m, m["step"] % 20 == 0, m)
            self.assertEqual("eval_acc_norm" in m, m["step"] % 20 == 0, m)
            if "val_loss" in m:  # the set reads what data.val does
                self.assertEqual(m["val_sets"], {"copy": m["val_loss"]}, m)
            self.assertEqual("val_sets" in m, "val_loss" in m, m)
            # 3 sequences of web and 1 of src2 a step: the loss is their weighted mean
            self.assertEqual(list(m["loss_sources"]), ["web", "src2"], m)
            src = m["loss_sources"]
            self.assertAlmostEqual((3 * src["web"] + src["src2"]) / 4, m["loss"],
                                   delta=1e-6 * m["loss"])
        self.assertNotIn("loss_sources", m0)
        self.assertLess(ms[-1]["loss"], ms[0]["loss"], "the loss did not go down")
        # committed checkpoints
        for s in (20, 40):
            d = os.path.join(ckpt, "step-%08d" % s)
            self.assertTrue(os.path.isfile(os.path.join(d, "MANIFEST")), os.listdir(ckpt))
            self.assertTrue(glob.glob(os.path.join(d, "shard-*.bin")))
        # the run directory's layout, and distrainctl logs reading it
        log = os.path.join(run_dir, "node-0", "job-1", "rank-0.log")
        self.assertTrue(os.path.isfile(log), os.listdir(run_dir))
        self.assertIn("==== job job-1 generation 1 rank 0", tail(log, 1000))
        for f in ("coordinator.log", "node-0/agent.log", "token"):
            self.assertTrue(os.path.exists(os.path.join(run_dir, f)), f)
        r = self.ctl("logs", "job-1", "--work-dir", os.path.join(run_dir, "node-*"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("==== job job-1 generation 1 rank 0", r.stdout)
        # nothing is left running
        self.assertEqual(procs_under(run_dir), [])
        # The same job again: its checkpoint.dir holds a run, refused at once in the job
        # spec's words (the trainer's flags are the coordinator's), not restarted.
        r = self.ctl("run", "--local", "--run-dir", run_dir, job, timeout=120)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("%s already holds a committed checkpoint (step 40): set the job's "
                      "model.init to \"%s\" to continue it, or use another checkpoint.dir (the "
                      "job's input or configuration: not restarted)" % (ckpt, ckpt), r.stderr)

    def test_interrupted(self):
        """Ctrl-C in the terminal (SIGINT to distrainctl's whole process group, the local
        coordinator, agents and trainers included), and SIGTERM to distrainctl alone (a
        supervisor stopping it): either way distrainctl stops the job, takes its daemons down,
        says so and exits 1 within seconds, and nothing it started is left running. Nor when
        distrainctl is killed outright (SIGKILL; a `| head` that closed its pipe, a closed
        terminal): its daemons get SIGTERM as it dies (before, they ran on without it, the
        trainers training to the end, and the coordinator and agents forever)."""
        for how in ("SIGINT to the group", "SIGTERM to distrainctl", "SIGKILL to distrainctl"):
            with self.subTest(how):
                tag = how.split()[0].lower()
                run_dir = os.path.join(self.tmp, "run_" + tag)
                job = os.path.join(self.tmp, "job_%s.yaml" % tag)
                with open(job, "w") as f:  # far longer than the test waits
                    f.write(job_yaml(os.path.join(self.tmp, "ckpt_" + tag), 100000, every=0,
                                     val_every=0))

                def left():  # trainers work in the run directory; the daemons name it
                    return procs_under(run_dir) + [
                        pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                        if run_dir in cmdline(pid) and proc_alive(pid)]
                p = subprocess.Popen([binary("coordinator", "distrainctl"), "run", "--local",
                                      "--nodes", "2", "--run-dir", run_dir, job],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env, cwd=self.tmp, start_new_session=True)
                try:
                    logs = os.path.join(run_dir, "node-*", "job-1", "rank-0.log")
                    wait_until(lambda: any("step " in tail(f, 5) for f in glob.glob(logs)), 60,
                               "the job to train")
                    t0 = time.time()
                    if tag == "sigint":
                        os.killpg(p.pid, signal.SIGINT)
                    else:
                        p.send_signal(getattr(signal, tag.upper()))
                    _, err = p.communicate(timeout=30)
                    if tag == "sigkill":  # nobody waits for the daemons: they stop on their own
                        wait_until(lambda: not left(), 20, "distrainctl's daemons to stop")
                finally:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                    remaining = left()
                    for pid in remaining:  # killed, so that the next case can run
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                sys.stderr.write("[%s: exited in %.1f s] " % (how, time.time() - t0))
                if tag == "sigkill":
                    self.assertEqual(p.returncode, -signal.SIGKILL, err[-2000:])
                    self.assertIn("signal 15: stopping trainers and exiting",
                                  tail(os.path.join(run_dir, "node-0", "agent.log")))
                else:
                    self.assertEqual(p.returncode, 1, err[-2000:])
                    self.assertIn("distrainctl: interrupted: stopping job-1", err)
                self.assertEqual(remaining, [])

    def test_two_rank_job_on_three_agents(self):
        """A dp=2 (ZeRO-1) job on 3 agents of 1 device: 2 nodes take a rank each, the
        checkpoint is committed from 2 shards, and the losses equal a 1-rank run of the same
        global batch (the ranks really cooperate: gradients are averaged across them). run
        prints rank 0's samples (training.sample_every's and the end's), each once, from
        whichever agent ran it (not always the first started)."""
        steps = 12
        losses = {}
        for dp in (1, 2):
            ckpt = os.path.join(self.tmp, "ckpt%d" % dp)
            run_dir = os.path.join(self.tmp, "run%d" % dp)
            metrics = os.path.join(self.tmp, "metrics%d.jsonl" % dp)
            job = os.path.join(self.tmp, "job%d.yaml" % dp)
            with open(job, "w") as f:
                f.write(job_yaml(ckpt, steps, every=steps, val_every=0, min_nodes=dp,
                                 max_nodes=dp))
            args = ["run", "--local", "--nodes", "3", "--run-dir", run_dir, "--metrics", metrics,
                    "--set", "parallel.dp=%d" % dp, "--set", "parallel.zero_stage=1",
                    "--set", "training.micro_batch=%d" % (TINY["batch"] // dp),
                    "--set", "training.sample=16", "--set", "training.sample_every=6", job]
            # DISTRAIN_* tunables given to the agents reach their trainers: comm debug lines.
            env = dict(self.env, DISTRAIN_DEBUG="debug", DISTRAIN_DEBUG_SUBSYS="comm")
            r = self.ctl(*args, timeout=180, env=env)
            self.assertEqual(r.returncode, 0, "dp=%d run failed:\n%s\n%s" % (
                dp, r.stderr[-3000:], tail(os.path.join(run_dir, "coordinator.log"))))
            self.assertIn("all 2 ranks finished" if dp == 2 else "its rank finished", r.stderr)
            # rank 0's samples, each once: after step 6 (printed as it came) and at the end
            self.assertEqual(re.findall(r"---- sample (.*) ----\n", r.stdout),
                             ["after step 6 (temperature 0.80)", "(temperature 0.80)"])
            self.assertEqual(r.stdout.count("---- end of sample ----\n"), 2)
            if dp == 2:
                text = "".join(open(p).read() for p in glob.glob(
                    os.path.join(run_dir, "node-*", "**", "rank-*.log"), recursive=True))
                for rank in range(dp):
                    self.assertIn("rank %d/2 up (cpu)" % rank, text)
            with open(metrics) as f:
                losses[dp] = [json.loads(x)["loss"] for x in f.read().splitlines()]
            with open(os.path.join(ckpt, "step-%08d" % steps, "MANIFEST")) as f:
                self.assertIn("world %d" % dp, f.read())
            self.assertEqual(procs_under(run_dir), [])
        self.assertEqual(len(losses[1]), steps)
        self.assertEqual(len(losses[2]), steps)
        for a, b in zip(losses[1], losses[2]):
            self.assertLess(abs(a - b) / abs(a), 1e-5, (losses[1], losses[2]))

    def test_pipeline_and_tensor_parallel_job(self):
        """pp=2 x tp=2 on 2 agents with 2 devices each: the coordinator places each stage's
        tensor-parallel pair on one node, every rank logs its part of the model, the
        checkpoint is committed from 4 shards, and the losses equal a one-device run of the
        same job (2 micro-batches per step through the 1F1B pipeline). So do those of cp=2 on
        2 agents (each sequence split over the two nodes)."""
        steps = 10
        losses = {}
        for pp, tp, cp in ((1, 1, 1), (2, 2, 1), (1, 1, 2)):
            tag = "pp%d_tp%d_cp%d" % (pp, tp, cp)
            n_nodes = pp * cp
            ckpt = os.path.join(self.tmp, "ckpt_" + tag)
            run_dir = os.path.join(self.tmp, "run_" + tag)
            metrics = os.path.join(self.tmp, "metrics_%s.jsonl" % tag)
            job = os.path.join(self.tmp, "job_%s.yaml" % tag)
            with open(job, "w") as f:
                f.write(job_yaml(ckpt, steps, every=steps, val_every=0, min_nodes=n_nodes,
                                 max_nodes=n_nodes))
            r = self.ctl("run", "--local", "--nodes", str(n_nodes), "--devices-per-node", str(tp),
                         "--run-dir", run_dir, "--metrics", metrics,
                         "--set", "parallel.tp=%d" % tp, "--set", "parallel.pp=%d" % pp,
                         "--set", "parallel.cp=%d" % cp, "--set", "training.micro_batch=2", job,
                         timeout=180)
            self.assertEqual(r.returncode, 0, "%s run failed:\n%s\n%s" % (
                tag, r.stderr[-3000:], tail(os.path.join(run_dir, "coordinator.log"))))
            if pp == 2:
                nodes = {}
                for rank in range(4):
                    stage, t = rank // 2, rank % 2
                    logs = glob.glob(os.path.join(run_dir, "node-*", "job-1", "rank-%d.log" % rank))
                    self.assertEqual(len(logs), 1, logs)
                    nodes.setdefault(stage, set()).add(logs[0].split(os.sep)[-3])
                    text = tail(logs[0], 20000)
                    self.assertIn("plan: rank %d of 4 in pp 2 x dp 1 x cp 1 x tp 2 at pp %d tp %d "
                                  "dp 0 cp 0: layers %d..%d" % (rank, stage, t, stage, stage), text)
                    self.assertIn("heads %d..%d of 2" % (t, t), text)
                    self.assertIn("pipeline: stage %d of 2, schedule 1f1b, 2 micro-batches" % stage,
                                  text)
                    self.assertIn("replicated parameters identical on all 2 tp ranks", text)
                # each stage's tensor-parallel pair on one node, the stages on different nodes
                self.assertEqual([len(nodes[0]), len(nodes[1])], [1, 1], nodes)
                self.assertNotEqual(nodes[0], nodes[1], nodes)
            if cp == 2:
                for rank in range(2):
                    logs = glob.glob(os.path.join(run_dir, "node-*", "job-1", "rank-%d.log" % rank))
                    self.assertIn("sequence chunk %d of 2" % rank, tail(logs[0], 20000))
            with open(metrics) as f:
                losses[tag] = [json.loads(x)["loss"] for x in f.read().splitlines()]
            with open(os.path.join(ckpt, "step-%08d" % steps, "MANIFEST")) as f:
                self.assertIn("world %d" % (pp * tp), f.read())  # ZeRO-0: one writer per part
            self.assertEqual(procs_under(run_dir), [])
        ref = losses.pop("pp1_tp1_cp1")
        for tag, got in losses.items():
            self.assertEqual(len(got), steps, tag)
            for a, b in zip(ref, got):
                self.assertLess(abs(a - b) / abs(a), 1e-5, (tag, ref, got))

    def test_job_the_local_cluster_cannot_hold_is_refused(self):
        """run --local's nodes are all it will have: a job they can never hold (its own
        max_nodes keeps it to one node of 2 devices; a tensor-parallel group wider than a
        node) is refused with the reason before anything starts, not left waiting."""
        job = os.path.join(self.tmp, "wide.yaml")
        with open(job, "w") as f:
            f.write(job_yaml(os.path.join(self.tmp, "ckpt"), 10))
        run_dir = os.path.join(self.tmp, "run")
        for devices, sets, why in (
                (2, ["parallel.pp=2", "parallel.tp=2"],
                 "world 4 (pp 2 x dp 1 x cp 1 x tp 2) needs 4 devices, 1 node offers 2. It has 2 "
                 "nodes of 2 devices (--nodes, --devices-per-node), of which the job may use 1 "
                 "(--set elastic.max_nodes=2 lets it use all)"),
                (1, ["parallel.tp=2", "elastic.max_nodes=2"],
                 "tp=2 needs 2 devices on one node; the largest node has 1. It has 2 nodes of 1 "
                 "device (--nodes, --devices-per-node)\n")):
            args = ["run", "--local", "--nodes", "2", "--devices-per-node", str(devices),
                    "--run-dir", run_dir]
            for kv in sets:
                args += ["--set", kv]
            r = self.ctl(*(args + [job]), timeout=30)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("distrainctl: this local cluster can never run the job: " + why, r.stderr)
            self.assertFalse(os.path.exists(run_dir), "a run directory was created")
            self.assertEqual(procs_under(self.tmp), [])

    def test_job_starts_on_every_agent(self):
        """run --local submits the job once every agent has registered: a dp=2 job that may use
        both nodes (elastic.max_nodes 2, min_nodes 1) starts at dp 2 on both, not at dp 1 on
        the first agent to register (as it could before: the coordinator places a job on the
        nodes it has, and grows it only after a checkpoint). Where the job may use fewer nodes
        than its dp needs (the default max_nodes 1), it runs at the dp they hold, and
        distrainctl says so before it starts."""
        note = ("distrainctl: the job asks for dp 2 but runs at dp 1: elastic.max_nodes 1 lets "
                "it use 1 of the 2 nodes (--set elastic.max_nodes=2 lets it use all)\n")
        for max_nodes in (2, 1):
            run_dir = os.path.join(self.tmp, "run%d" % max_nodes)
            job = os.path.join(self.tmp, "job%d.yaml" % max_nodes)
            with open(job, "w") as f:
                f.write(job_yaml(os.path.join(self.tmp, "ckpt%d" % max_nodes), 4, every=0,
                                 val_every=0, max_nodes=max_nodes))
            r = self.ctl("run", "--local", "--nodes", "2", "--run-dir", run_dir,
                         "--set", "parallel.dp=2", "--set", "training.micro_batch=2", job,
                         timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            dp = max_nodes  # generation 1 ran dp ranks, one a node (a fast job's placement
            # may fall between distrainctl's polls: the trainers' logs say it)
            logs = glob.glob(os.path.join(run_dir, "node-*", "job-1", "rank-*.log"))
            self.assertEqual(len(logs), dp, logs)
            self.assertEqual(len({os.path.dirname(f) for f in logs}), dp, logs)
            for f in logs:
                self.assertIn("==== job job-1 generation 1 rank", tail(f, 100000))
            rank0 = [f for f in logs if f.endswith("rank-0.log")]
            self.assertIn("batch 2 x seq 32 x accum %d x dp %d = 128 tokens/step" % (3 - dp, dp),
                          tail(rank0[0], 100000))
            self.assertEqual(note in r.stderr, dp == 1, r.stderr[-3000:])
            self.assertEqual(procs_under(run_dir), [])

    def test_bad_yaml_is_refused_before_anything_starts(self):
        job = os.path.join(self.tmp, "bad.yaml")
        text = job_yaml(os.path.join(self.tmp, "ckpt"), 10).splitlines()
        # line 5 (1-based) is the training section: add an unknown key to it
        self.assertTrue(text[4].startswith("training:"), text[4])
        text[4] = text[4].replace("threads: 1", "threads: 1, bogus_key: 3")
        with open(job, "w") as f:
            f.write("\n".join(text) + "\n")
        run_dir = os.path.join(self.tmp, "run")
        r = self.ctl("run", "--local", "--run-dir", run_dir, job, timeout=30)
        self.assertIn(r.returncode, (1, 2), r.stderr)
        self.assertIn("bogus_key", r.stderr)
        self.assertIn("bad.yaml:5", r.stderr)
        self.assertFalse(os.path.exists(run_dir), "a run directory was created for a bad job")
        self.assertEqual(procs_under(self.tmp), [])
        # submit refuses it the same way, without a coordinator to talk to
        r = self.ctl("submit", "--coordinator", "127.0.0.1:1", "--token-file", self.token_file,
                     job, timeout=30)
        self.assertIn(r.returncode, (1, 2), r.stderr)
        self.assertIn("bogus_key", r.stderr)


# ---------------------------------------------------------------------------------------------
# 4. An agent killed with SIGKILL
# ---------------------------------------------------------------------------------------------

class T4_AgentKilled(ClusterTest):
    def check_nodes_listing(self, hosts):
        """distrainctl nodes (--json): each agent's devices, its CPU one here (cuda ones, with
        a name and memory, where the machine has GPUs); usage only for GPUs."""
        args = ["--coordinator", self.addr, "--token-file", self.token_file]
        r = self.ctl("nodes", "--json", *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        listed = json.loads(r.stdout)
        self.assertEqual(sorted(n["hostname"] for n in listed), hosts)
        for n in listed:
            self.assertEqual(n["state"], "ALIVE")
            self.assertGreaterEqual(len(n["devices"]), 1, n)
            for i, d in enumerate(n["devices"]):
                self.assertEqual(d["index"], i, n)
                if d["kind"] == "cpu":
                    self.assertEqual(d, {"kind": "cpu", "index": i, "name": "cpu",
                                         "memory_bytes": 0})
                else:
                    self.assertEqual(d["kind"], "cuda", n)
                    self.assertTrue(d["name"] and d["memory_bytes"] > 0, n)
            if n["device_kind"] == "cpu":
                self.assertEqual(n["usage"], [], n)
        r = self.ctl("nodes", *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertEqual(len(lines), 1 + len(hosts), r.stdout)
        self.assertTrue(lines[0].startswith("NODE") and lines[0].endswith("DEVICES"), r.stdout)
        for line in lines[1:]:
            self.assertRegex(line, r"\b\d+x \S", r.stdout)

    def test_killed_agent_is_detected_and_the_job_moves(self):
        self.start_coordinator()
        for i in range(3):
            self.start_agent("h%d" % i)
        self.wait_nodes(3)
        self.check_nodes_listing(["h0", "h1", "h2"])
        job_id = self.submit_yaml(job_yaml(os.path.join(self.tmp, "ckpt"), 100000, shape=SLOW,
                                           every=50, val_every=0))
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        self.assertEqual(j.generation, 1)
        node, tr = wait_until(lambda: self.trainer_of(job_id, 1), 10, "a running trainer")
        agent = self.agents[node.info.hostname]
        self.assertEqual(proc_ppid(tr.pid), agent.pid, "the trainer is not the agent's child")
        self.assertEqual(proc_comm(tr.pid), "distrain-train")
        self.assertEqual(len([n for n in self.nodes() if n.trainers]), 1)

        agent.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        wall_kill = time.time() * 1000

        def left_running():
            j = self.get_job(job_id)
            return j if (j.state != pb.JOB_RUNNING or j.generation != 1) else None

        j = wait_until(left_running, 10, "the job to leave RUNNING", interval=0.01)
        latency = time.monotonic() - t_kill
        agent.wait(timeout=5)
        # The trainer died with its agent (PR_SET_PDEATHSIG).
        wait_until(lambda: not proc_alive(tr.pid), 2, "trainer pid %d to die" % tr.pid)

        limit = HEARTBEAT_MS * 3 / 1000.0 + 1.0
        sys.stderr.write("[agent SIGKILL -> job left RUNNING in %.0f ms (coordinator: %.0f ms), "
                         "limit %.0f ms] " % (latency * 1000, j.updated_ms - wall_kill,
                                               limit * 1000))
        self.assertLess(latency, limit)
        self.assertIn(node.node_id, list(j.failed_nodes))
        self.assertEqual(j.restarts, 1)
        if j.state == pb.JOB_RECOVERING:
            self.assertIn(node.node_id, j.reason)
        else:
            # Idle nodes exist, so the job was re-planned at once onto another node.
            self.assertIn(j.state, (pb.JOB_RENDEZVOUS, pb.JOB_RUNNING), pb.JobState.Name(j.state))
            self.assertEqual(j.generation, 2)
            self.assertNotIn(node.node_id, j.reason)  # "world 1 ..., on node-N"
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: \w+ -> RECOVERING .*%s \(%s\) missed heartbeats"
                             % (job_id, node.node_id, node.info.hostname))
        dead = [n for n in self.nodes() if n.node_id == node.node_id][0]
        self.assertEqual(dead.state, pb.NODE_DEAD)
        # Generation 2 runs on a different node.
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20)
        self.assertEqual(j.generation, 2)
        node2, tr2 = wait_until(lambda: self.trainer_of(job_id, 2), 10, "a generation-2 trainer")
        self.assertNotEqual(node2.node_id, node.node_id)
        self.assertNotEqual(tr2.pid, tr.pid)
        self.assertEqual(proc_ppid(tr2.pid), self.agents[node2.info.hostname].pid)


    def test_lost_node_shrinks_the_job_then_it_grows_back(self):
        """A dp=2 job on two nodes loses one: it goes on as dp=1 on the other (gradient
        accumulation keeps the global batch) after one restart blamed on the lost node (the
        survivor's "peer failed" error waits for that verdict). When the node's agent is back,
        the job grows
        back to dp=2 at its next checkpoint (a restart from that checkpoint that does not count
        against max_restarts) and completes there."""
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        steps = slow_steps(12.0)
        every = max(steps // 8, 1)
        steps = 8 * every
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=every, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        stream = os.path.join(self.tmp, "metrics.jsonl")
        watch = subprocess.Popen([binary("coordinator", "distrainctl"), "status", job_id,
                                  "--watch", "--metrics", stream, "--coordinator", self.addr,
                                  "--token-file", self.token_file], env=self.env, cwd=self.tmp,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        self.assertEqual((j.world_size, j.requested_dp), (2, 2))

        self.agents["h1"].send_signal(signal.SIGKILL)
        self.agents["h1"].wait(timeout=5)
        shrunk = wait_until(lambda: (lambda x: x if x.state == pb.JOB_RUNNING and x.world_size
                                     == 1 else None)(self.get_job(job_id)), 20,
                            "the job to run on the remaining node")
        self.assertEqual((shrunk.spec.parallel.dp, shrunk.restarts), (1, 1))
        self.assertLess(shrunk.step, steps - 2 * every, "too late to see the job grow back")
        # The survivor's "peer failed" error arrived first, but the recovery waited for the
        # lost node's verdict: one restart, blamed on h1, not a second one onto the dying node.
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        self.assertRegex(log, r"job %s: RUNNING -> RECOVERING \(generation 1\): node \S+ \(h1\) "
                         r"missed heartbeats" % job_id)

        self.start_agent("h1")
        grown = wait_until(lambda: (lambda x: x if x.generation > shrunk.generation and x.state in (
            pb.JOB_RUNNING, pb.JOB_COMPLETED) else None)(self.get_job(job_id)), 60,
                           "the job to grow back")
        self.assertEqual((grown.world_size, grown.spec.parallel.dp, grown.restarts),
                         (2, 2, shrunk.restarts))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: RUNNING -> RECOVERING \(generation %d\): "
                             r"growing from dp 1 to dp 2 at checkpoint step \d+"
                             % (job_id, shrunk.generation))
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.generation, done.restarts, done.step, done.committed_step),
                         (grown.generation, shrunk.restarts, steps, steps))
        # Every step after the shrunk generation's checkpoint, the last ones of each generation
        # included, reached the coordinator and the --metrics stream, in order. (Steps up to
        # a commit that the killed node had not yet sent are lost with it: not checked.)
        self.assertEqual(watch.wait(timeout=30), 0)
        want = list(range(shrunk.committed_step + 1, steps + 1))
        got = [m.step for m in self.call("GetJobMetrics", pb.GetJobMetricsRequest(
            job_id=job_id)).metrics]
        self.assertEqual([s for s in got if s > shrunk.committed_step], want)
        with open(stream) as f:
            streamed = [json.loads(line)["step"] for line in f]
        self.assertEqual([s for s in streamed if s > shrunk.committed_step], want)


# ---------------------------------------------------------------------------------------------
# 5. The coordinator killed with SIGKILL and restarted mid-job
# ---------------------------------------------------------------------------------------------

class T5_CoordinatorRestart(ClusterTest):
    def test_coordinator_restart_does_not_disturb_trainers(self):
        port = free_port()
        self.start_coordinator(port=port)
        agent = self.start_agent("h0")
        self.wait_nodes(1)
        steps = slow_steps(8.0)
        ckpt = os.path.join(self.tmp, "ckpt")
        every = steps // 4
        steps = 4 * every  # checkpoints at 1/4, 2/4, 3/4 and the end
        sys.stderr.write("[%d steps of ~%.1f ms] " % (steps, _SHARED["slow_ms"]))
        job_id = self.submit_yaml(job_yaml(ckpt, steps, shape=SLOW, every=every, val_every=0))
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=20)
        gen = j.generation
        node, tr = wait_until(lambda: self.trainer_of(job_id, gen), 10, "a running trainer")
        self.assertEqual(proc_ppid(tr.pid), agent.pid)

        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait(timeout=5)
        time.sleep(0.5)  # the agent's heartbeats fail meanwhile; the trainer keeps training
        self.assertTrue(proc_alive(tr.pid))
        self.start_coordinator(port=port)
        t_restart = time.monotonic()

        j2 = self.get_job(job_id)
        self.assertEqual(j2.generation, gen)
        self.assertIn(j2.state, (pb.JOB_RUNNING,), pb.JobState.Name(j2.state))
        self.assertEqual(j2.spec, j.spec)
        # The agent reconnects, reporting the same trainer: same pid, same generation.
        node2, tr2 = wait_until(lambda: self.trainer_of(job_id), 10,
                                "the agent to report its trainer to the new coordinator")
        self.assertEqual(node2.node_id, node.node_id)
        self.assertEqual((tr2.pid, tr2.generation), (tr.pid, gen))
        self.assertGreater(tr2.step, j.step)
        # ... and keeps doing so: the node is never declared dead, nothing is restarted.
        while time.monotonic() - t_restart < 2.5:
            jj = self.get_job(job_id)
            if jj.state == pb.JOB_COMPLETED:
                break
            self.assertEqual((jj.state, jj.generation, jj.restarts), (pb.JOB_RUNNING, gen, 0),
                             "after the restart: %s" % jj.reason)
            self.assertTrue(proc_alive(tr.pid))
            time.sleep(0.1)
        j3 = self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        self.assertEqual((j3.generation, j3.restarts, j3.step), (gen, 0, steps))
        self.assertEqual(list(j3.failed_nodes), [])
        self.assertEqual(j3.committed_step, steps)
        with open(os.path.join(self.tmp, "agent-h0.log")) as f:
            self.assertEqual(f.read().count("started job %s" % job_id), 1,
                             "the trainer was restarted")
        # Every step's metrics reached the coordinator, including the ones made while it was down.
        m = self.call("GetJobMetrics", pb.GetJobMetricsRequest(job_id=job_id)).metrics
        self.assertEqual([x.step for x in m], list(range(1, steps + 1)))
        for s in range(every, 4 * every + 1, every):
            self.assertTrue(os.path.isfile(os.path.join(ckpt, "step-%08d" % s, "MANIFEST")), s)


    def test_ten_coordinator_restarts_in_a_row(self):
        """The issue's goal: the coordinator SIGKILLed and restarted 10 times during a dp=2 job
        on two agents (checkpoints every few steps, so reports and KV calls are in flight):
        no trainer is restarted (one generation, the same pids), every step's metrics arrive,
        and the losses equal an uninterrupted run's of the same job, bit for bit."""
        port = free_port()
        self.start_coordinator(port=port)
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        steps = slow_steps(12.0)
        every = max(steps // 12, 1)
        steps = 12 * every

        def submit(tag):
            spec = job_spec(os.path.join(self.tmp, "ckpt-" + tag), steps, shape=SLOW, every=every,
                            dp=2)
            return self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id

        ref_id = submit("ref")
        self.wait_state(ref_id, [pb.JOB_COMPLETED], 120)
        ref = self.call("GetJobMetrics", pb.GetJobMetricsRequest(job_id=ref_id)).metrics
        job_id = submit("restarts")
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=1)
        pids = sorted(t.pid for n in self.nodes() for t in n.trainers if t.job_id == job_id)
        for i in range(10):
            self.coord.send_signal(signal.SIGKILL)
            self.coord.wait(timeout=5)
            time.sleep(0.2)
            self.start_coordinator(port=port)
            j = wait_until(lambda: (lambda x: x if x.state in (pb.JOB_RUNNING, pb.JOB_COMPLETED)
                                    else None)(self.job_now(job_id)), 20,
                           "the job after restart %d" % (i + 1))
            self.assertEqual((j.generation, j.restarts), (1, 0), j.reason)
            if j.state == pb.JOB_COMPLETED:
                break
            time.sleep(0.3)
        self.assertGreater(i, 5, "the job ended before most restarts: make it longer")
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.generation, done.restarts, done.committed_step), (1, 0, steps))
        for h in ("h0", "h1"):
            with open(os.path.join(self.tmp, "agent-%s.log" % h)) as f:
                self.assertEqual(f.read().count("started job %s" % job_id), 1)
        self.assertEqual(len(pids), 2)
        got = self.call("GetJobMetrics", pb.GetJobMetricsRequest(job_id=job_id)).metrics
        self.assertEqual([m.step for m in got], list(range(1, steps + 1)))
        self.assertEqual([m.loss for m in got], [m.loss for m in ref])
        sys.stderr.write("[%d coordinator restarts during %d steps] " % (i + 1, steps))

    def test_coordinator_killed_during_a_checkpoint_report(self):
        """The coordinator stopped before a checkpoint boundary, then killed while the trainer's
        report of its shard is in flight, then restarted: the trainer reports again to the new
        coordinator and carries on; the step is committed, nothing is restarted."""
        port = free_port()
        self.start_coordinator(port=port)
        self.start_agent("h0")
        self.wait_nodes(1)
        steps = slow_steps(6.0)
        every = steps // 3
        steps = 3 * every
        ckpt = os.path.join(self.tmp, "ckpt")
        job_id = self.submit_yaml(job_yaml(ckpt, steps, shape=SLOW, every=every, val_every=0))
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        self.assertLess(j.step, every // 2, "too late to stop the coordinator before step %d"
                        % every)
        self.coord.send_signal(signal.SIGSTOP)
        first = os.path.join(ckpt, "step-%08d" % every)
        wait_until(lambda: os.path.isdir(first) and os.listdir(first), 30,
                   "the trainer to write its shard of step %d" % every)
        time.sleep(0.5)  # its report is now waiting on the stopped coordinator
        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait(timeout=5)
        self.start_coordinator(port=port)
        j2 = self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        self.assertEqual((j2.generation, j2.restarts, j2.step, j2.committed_step),
                         (j.generation, 0, steps, steps), j2.reason)
        self.assertTrue(os.path.isfile(os.path.join(first, "MANIFEST")))
        with open(os.path.join(self.tmp, "agent-h0.log")) as f:
            self.assertEqual(f.read().count("started job %s" % job_id), 1,
                             "the trainer was restarted")


class T5b_StoreFailure(ClusterTest):
    def test_failed_store_writes_fail_the_call_and_are_caught_up(self):
        """While another process holds the state database's write lock the coordinator's writes
        fail: SubmitJob fails UNAVAILABLE and submits nothing (it replied OK, and a restart
        lost the job); StopJob fails UNAVAILABLE although the job stopped in memory. Once the
        lock is gone the coordinator rewrites its state, and after kill -9 and a restart the
        job is there, stopped."""
        self.start_coordinator()
        ck = os.path.join(self.tmp, "ck")
        log = os.path.join(self.tmp, "coordinator.log")
        locker = sqlite3.connect(os.path.join(self.tmp, "state", "coordinator.db"),
                                 isolation_level=None, timeout=5)
        try:
            locker.execute("BEGIN EXCLUSIVE")
            with self.assertRaises(grpc.RpcError) as ctx:
                self.call("SubmitJob", pb.SubmitJobRequest(spec=job_spec(ck, 3)), timeout=10)
            self.assertCode(ctx, grpc.StatusCode.UNAVAILABLE)
            self.assertIn("the job was not submitted", ctx.exception.details())
            self.assertEqual(len(self.call("ListJobs", pb.ListJobsRequest()).jobs), 0)
            locker.execute("COMMIT")
            job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=job_spec(ck, 3))).job_id
            self.assertEqual(job_id, "job-1")

            seen = len(read_text(log))
            locker.execute("BEGIN EXCLUSIVE")
            with self.assertRaises(grpc.RpcError) as ctx:
                self.call("StopJob", pb.StopJobRequest(job_id=job_id), timeout=10)
            self.assertCode(ctx, grpc.StatusCode.UNAVAILABLE)
            self.assertEqual(self.get_job(job_id).state, pb.JOB_STOPPED)
            locker.execute("COMMIT")
        finally:
            locker.close()
        wait_until(lambda: "the state store is writable again" in read_text(log)[seen:], 10,
                   "the coordinator to rewrite its state")
        self.coord.kill()
        self.coord.wait()
        self.start_coordinator()
        self.assertEqual(self.get_job(job_id).state, pb.JOB_STOPPED)

    def test_step_metrics_survive_a_kill_while_the_store_fails(self):
        """Heartbeats carrying step metrics fail UNAVAILABLE while the store cannot be written,
        so the agent keeps the metrics and sends them again; the coordinator is killed before
        the store recovers, and after its restart the job's metrics still have every step (an
        acknowledged heartbeat had lost the steps of the outage)."""
        self.start_coordinator()
        self.start_agent("h0")
        steps = slow_steps(8)
        spec = job_spec(os.path.join(self.tmp, "ck"), steps, shape=SLOW)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        start = self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 8).step
        locker = sqlite3.connect(os.path.join(self.tmp, "state", "coordinator.db"),
                                 isolation_level=None, timeout=5)
        try:
            locker.execute("BEGIN EXCLUSIVE")
            wait_until(lambda: self.get_job(job_id).step >= start + steps // 8, 30,
                       "steps while the store is locked")
            self.coord.kill()
            self.coord.wait()
        finally:
            locker.close()
        self.start_coordinator(port=self.port)
        self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        got = [m.step for m in self.call("GetJobMetrics", pb.GetJobMetricsRequest(
            job_id=job_id, after_step=0)).metrics]
        self.assertEqual(got, list(range(1, steps + 1)),
                         "steps missing: %s" % sorted(set(range(1, steps + 1)) - set(got)))


def ip(*args):
    subprocess.run(["ip"] + list(args), check=True, capture_output=True, text=True, timeout=30)


class T5c_NetworkPartition(ClusterTest):
    """Real separate hosts: the coordinator and each agent in a network namespace of its own
    (distinct addresses, joined by veth pairs on a bridge in the coordinator's namespace; this
    test reaches the coordinator through one more veth pair), made here and removed after."""
    NET = "10.213.0.%d"  # the cluster's subnet, inside the namespaces only

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0 or not shutil.which("ip"):
            self.skipTest("making network namespaces needs root and iproute2 (ip netns)")
        tag = "dt%d" % os.getpid()
        self.ns = {name: "%s-%s" % (tag, name) for name in ("coord", "h0", "h1")}
        self.addCleanup(self.remove_namespaces)
        try:
            for ns in self.ns.values():
                ip("netns", "add", ns)
                ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.skipTest("cannot make network namespaces here: %s" % e.stderr.strip())
        c = self.ns["coord"]
        ip("-n", c, "link", "add", "br0", "type", "bridge")
        ip("-n", c, "addr", "add", self.NET % 1 + "/24", "dev", "br0")
        ip("-n", c, "link", "set", "br0", "up")
        for i, host in enumerate(("h0", "h1")):
            ip("link", "add", "%s%s" % (tag, host), "type", "veth", "peer", "name", "p" + host,
               "netns", c)
            ip("link", "set", "%s%s" % (tag, host), "netns", self.ns[host], "name", "eth0")
            ip("-n", self.ns[host], "addr", "add", self.NET % (10 + i) + "/24", "dev", "eth0")
            ip("-n", self.ns[host], "link", "set", "eth0", "up")
            ip("-n", c, "link", "set", "p" + host, "master", "br0", "up")
        # This test's own way in: a /30 between the host and the coordinator's namespace.
        ip("link", "add", tag + "t", "type", "veth", "peer", "name", "eth9", "netns", c)
        ip("addr", "add", "10.214.0.2/30", "dev", tag + "t")
        ip("link", "set", tag + "t", "up")
        ip("-n", c, "addr", "add", "10.214.0.1/30", "dev", "eth9")
        ip("-n", c, "link", "set", "eth9", "up")

    def remove_namespaces(self):
        for p in self.procs:  # nothing may hold a namespace we delete
            if p.poll() is None:
                p.kill()
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def link(self, host, state):
        ip("-n", self.ns[host], "link", "set", "eth0", state)

    def test_partitioned_node_is_dead_then_rejoins_and_the_job_grows_back(self):
        """A dp=2 job on two hosts; h1's link goes down: h1 is declared dead within the
        heartbeat limit and the job goes on as dp=1 on h0. The link comes back: h1's agent
        rejoins by itself (no restart) and the job grows back to dp=2 at a checkpoint and
        completes there."""
        self.start_coordinator(host="0.0.0.0", netns=self.ns["coord"])
        self.addr = "10.214.0.1:%d" % self.port
        for i, host in enumerate(("h0", "h1")):
            self.start_agent(host, coordinator="%s:%d" % (self.NET % 1, self.port),
                             netns=self.ns[host], env={"DISTRAIN_COMM_HOST": self.NET % (10 + i)})
        self.wait_nodes(2)
        addrs = sorted(x.info.hostname for x in self.nodes())
        self.assertEqual(addrs, ["h0", "h1"])
        steps = slow_steps(12.0)
        every = max(steps // 8, 1)
        steps = 8 * every
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=every, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=1)

        self.link("h1", "down")
        t = time.monotonic()
        wait_until(lambda: any(x.info.hostname == "h1" and x.state == pb.NODE_DEAD
                               for x in self.nodes()), 10, "h1 declared dead")
        detect_s = time.monotonic() - t
        shrunk = wait_until(lambda: (lambda x: x if x.state == pb.JOB_RUNNING and x.world_size
                                     == 1 else None)(self.get_job(job_id)), 30,
                            "the job to run on h0 alone")
        self.assertLess(shrunk.step, steps - 2 * every, "too late to see the job grow back")

        self.link("h1", "up")
        t = time.monotonic()
        wait_until(lambda: any(x.info.hostname == "h1" and x.state == pb.NODE_ALIVE
                               for x in self.nodes()), 30, "h1 back")
        rejoin_s = time.monotonic() - t
        grown = wait_until(lambda: (lambda x: x if x.generation > shrunk.generation and x.state in (
            pb.JOB_RUNNING, pb.JOB_COMPLETED) else None)(self.get_job(job_id)), 90,
                           "the job to grow back")
        self.assertEqual((grown.world_size, grown.spec.parallel.dp), (2, 2))
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 180)
        self.assertEqual((done.step, done.committed_step), (steps, steps))
        self.assertEqual(self.agents["h1"].poll(), None, "h1's agent was not restarted")
        sys.stderr.write("[h1 dead after %.2f s of partition, back %.2f s after the link] "
                         % (detect_s, rejoin_s))


def png_pixels(path):
    """(width, height, rows of (r, g, b) tuples) of an 8-bit RGB or RGBA PNG, decoded here
    (zlib and the five scanline filters) so the test needs no imaging library."""
    import zlib
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, hdr
    bpp = 3 if ctype == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(w)])
        prev = line
    return w, h, rows


class T3b_StatusPlot(ClusterTest):
    # gnuplot's first three line colours: training, validation, the first validation set
    TRAIN, VAL, SET = (148, 0, 211), (0, 158, 115), (86, 180, 233)

    def test_status_plot_draws_the_loss_curve(self):
        """status JOB --plot FILE: a 960x540 PNG (gnuplot) with the training loss as a line
        that starts high on the left and ends low on the right, and validation points only
        for a job that evaluated (and its validation set's, data.val_sets); a line of each
        source of a blend; two jobs on one plot, a colour each; clear errors for a missing job,
        bad usage and no gnuplot."""
        self.assertTrue(shutil.which("gnuplot"), "gnuplot is missing (deploy/install-deps.sh)")
        self.start_coordinator()
        self.start_agent("h0")
        jobs = {}
        for val_every in (20, 0):
            spec = job_yaml(os.path.join(self.tmp, "ckpt%d" % val_every), 60, every=0,
                            val_every=val_every)
            if val_every:  # the training shards as a validation set: points of their own
                spec = spec.replace("}\ntraining: {", ", val_sets: \"train=%s\"}\ntraining: {"
                                    % shared_data()[0])
            else:  # another run to compare: its own curve
                spec = spec.replace("lr: 1.0e-3", "lr: 3.0e-3").replace("name: tiny", "name: lr3")
            jobs[val_every] = self.submit_yaml(spec, name="job%d.yaml" % val_every)
            self.wait_state(jobs[val_every], [pb.JOB_COMPLETED], 60)
        common = ["--coordinator", self.addr, "--token-file", self.token_file]
        for val_every, job_id in jobs.items():
            png = os.path.join(self.tmp, "loss%d.png" % val_every)
            r = self.ctl("status", job_id, "--plot", png, *common)
            self.assertEqual(r.returncode, 0, r.stderr)
            # kept in the build directory, for a person to look at
            shutil.copy(png, os.path.join(BUILD, "status-plot-%d.png" % val_every))
            w, h, rows = png_pixels(png)
            self.assertEqual((w, h), (960, 540))
            near = lambda p, q: sum(abs(u - v) for u, v in zip(p, q)) < 40  # anti-aliasing
            train = [(x, y) for y in range(h) for x in range(w) if near(rows[y][x], self.TRAIN)]
            val = [(x, y) for y in range(h) for x in range(w) if near(rows[y][x], self.VAL)]
            vset = [(x, y) for y in range(h // 4, h) for x in range(w)  # below the legend
                    if near(rows[y][x], self.SET)]
            self.assertGreater(len(train), 300, "no training curve")
            xs = sorted(x for x, _ in train)
            lo, hi = xs[len(xs) // 50], xs[-len(xs) // 50]
            # the legend's sample line is top right: look at the curve's first and last tenth
            left = [y for x, y in train if x < lo + (hi - lo) // 10]
            right = [y for x, y in train if x > hi - (hi - lo) // 10 and y > h // 8]
            self.assertLess(min(left), max(right), "the curve does not go down")
            if val_every:
                self.assertGreater(len(val), 20, "no validation points")
                # the first point is the validation before training, at step 0: left of step 1
                self.assertLess(min(x for x, _ in val), min(x for x, _ in train) - 3)
                self.assertGreater(len(vset), 20, "no points of the validation set")
            else:
                self.assertEqual(val, [], "validation points for a job that did not evaluate")
                self.assertEqual(vset, [], "validation set points for a job without one")
        # a job training on a blend (data.train), without validation: each source's loss a
        # dashed line, in the colours after the training line's
        data = shared_data()[0]
        spec = job_yaml(os.path.join(self.tmp, "ckpt-blend"), 60, every=0, val_every=0).replace(
            'train: "%s"' % data, 'train: "3:web=%s,1:%s"' % (data, data))
        blend = self.submit_yaml(spec, name="blend.yaml")
        self.wait_state(blend, [pb.JOB_COMPLETED], 60)
        png = os.path.join(self.tmp, "blend.png")
        r = self.ctl("status", blend, "--plot", png, *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        shutil.copy(png, os.path.join(BUILD, "status-plot-blend.png"))
        w, h, rows = png_pixels(png)
        for colour, what in ((self.TRAIN, "the loss"), (self.VAL, "web"), (self.SET, "src2")):
            curve = [(x, y) for y in range(h // 4, h) for x in range(w)
                     if near(rows[y][x], colour)]
            self.assertGreater(len(curve), 100, "no curve of " + what)
        # two runs compared: a colour each job (gnuplot's first two), its points in it
        png = os.path.join(self.tmp, "compare.png")
        r = self.ctl("status", jobs[20], jobs[0], "--plot", png, *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        shutil.copy(png, os.path.join(BUILD, "status-plot-compare.png"))
        w, h, rows = png_pixels(png)
        for colour, what in ((self.TRAIN, "the first job"), (self.VAL, "the second job")):
            curve = [(x, y) for y in range(h // 4, h) for x in range(w)
                     if near(rows[y][x], colour)]
            self.assertGreater(len(curve), 300, "no curve of " + what)
        self.assertEqual([(x, y) for y in range(h // 4, h) for x in range(w)
                          if near(rows[y][x], self.SET)], [], "a third colour for two jobs")
        r = self.ctl("status", "job-999", "--plot", os.path.join(self.tmp, "x.png"), *common)
        self.assertEqual(r.returncode, 1)
        self.assertIn("job-999", r.stderr)
        r = self.ctl("status", jobs[0], "job-998", "--plot", os.path.join(self.tmp, "x.png"),
                     *common)
        self.assertEqual(r.returncode, 1)
        self.assertIn("job-998", r.stderr)
        r = self.ctl("status", "--plot", os.path.join(self.tmp, "x.png"), *common)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--plot FILE needs one JOB, or up to 8 to compare", r.stderr)
        r = self.ctl("status", *([jobs[0]] * 9), "--plot", os.path.join(self.tmp, "x.png"),
                     *common)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--plot FILE needs one JOB, or up to 8 to compare", r.stderr)
        r = self.ctl("status", jobs[0], jobs[20], *common)
        self.assertEqual(r.returncode, 2)
        self.assertIn("expected at most one JOB (several with --plot FILE", r.stderr)
        r = self.ctl("status", jobs[0], "--plot", os.path.join(self.tmp, "x.png"), *common,
                     env=dict(self.env, PATH="/nonexistent"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("needs gnuplot", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "x.png")))
        # A coordinator that does not answer: every call gives up after
        # DISTRAIN_CTL_RPC_TIMEOUT_MS (the plot's used to wait 10 s and 30 s regardless).
        self.coord.send_signal(signal.SIGSTOP)
        try:
            quick = dict(self.env, DISTRAIN_CTL_RPC_TIMEOUT_MS="300")
            for args in (("status", jobs[0], "--plot", os.path.join(self.tmp, "x.png")),
                         ("status", jobs[0]), ("nodes",)):
                t0 = time.monotonic()
                r = self.ctl(*args, *common, env=quick, timeout=8)
                self.assertNotEqual(r.returncode, 0, args)
                self.assertIn("Deadline Exceeded", r.stderr, args)
                self.assertLess(time.monotonic() - t0, 5, args)
        finally:
            self.coord.send_signal(signal.SIGCONT)


# ---------------------------------------------------------------------------------------------
# 6. Stopping jobs and agents
# ---------------------------------------------------------------------------------------------

class T6_Stop(ClusterTest):
    GRACE_MS = 3000

    def test_stop_job_and_stop_agent(self):
        self.start_coordinator()
        agent = self.start_agent("h0", grace_ms=self.GRACE_MS)
        self.wait_nodes(1)
        work = os.path.join(self.tmp, "work-h0")
        ckpt = os.path.join(self.tmp, "ckpt")
        job1 = self.submit_yaml(job_yaml(ckpt, 100000, shape=SLOW, every=0, val_every=0))
        self.wait_state(job1, [pb.JOB_RUNNING], 20, min_step=1)
        _, tr = wait_until(lambda: self.trainer_of(job1), 10, "a running trainer")
        self.assertEqual(proc_ppid(tr.pid), agent.pid)

        step_at_stop = self.get_job(job1).step
        t_stop = time.monotonic()
        r = self.ctl("stop", job1, "--coordinator", self.addr, "--token-file", self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("STOPPED", r.stdout)
        j = self.wait_state(job1, [pb.JOB_STOPPED], 2)
        self.assertIn("stopped", j.reason)
        wait_until(lambda: not proc_alive(tr.pid), self.GRACE_MS / 1000.0,
                   "the trainer to exit within the grace period")
        gone_ms = (time.monotonic() - t_stop) * 1000
        # It finished its step and saved it (checkpoint.every is 0: no other save).
        saved = self.committed_steps(ckpt)
        self.assertEqual(len(saved), 1, saved)
        self.assertGreaterEqual(saved[0], step_at_stop)
        self.assertEqual(procs_under(work), [], "the agent left orphans")
        self.assertIsNone(agent.poll(), "the agent exited")
        # The job stays STOPPED; stopping it again is harmless.
        time.sleep(0.5)
        self.assertEqual(self.get_job(job1).state, pb.JOB_STOPPED)
        r = self.ctl("stop", job1, "--coordinator", self.addr, "--token-file", self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.ctl("stop", "job-404", "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertEqual(r.returncode, 1)
        self.assertIn("job-404", r.stderr)

        # `stop --now` kills the trainers at once: nothing is saved.
        job0 = self.submit_yaml(job_yaml(ckpt + "0", 100000, shape=SLOW, every=0, val_every=0),
                                name="job0.yaml")
        self.wait_state(job0, [pb.JOB_RUNNING], 20, min_step=1)
        _, tr0 = wait_until(lambda: self.trainer_of(job0), 10, "job 0's trainer")
        r = self.ctl("stop", job0, "--now", "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        wait_until(lambda: not proc_alive(tr0.pid), 2, "the trainer to be killed")
        self.assertEqual(self.committed_steps(ckpt + "0"), [])

        # The node takes the next job; then the agent itself is stopped with SIGTERM.
        job2 = self.submit_yaml(job_yaml(ckpt + "2", 100000, shape=SLOW, every=0, val_every=0),
                                name="job2.yaml")
        self.wait_state(job2, [pb.JOB_RUNNING], 20, min_step=1)
        _, tr2 = wait_until(lambda: self.trainer_of(job2), 10, "job 2's trainer")
        self.assertEqual(proc_ppid(tr2.pid), agent.pid)
        # `distrainctl status` without a job lists them all: a table, and a JSON array.
        common = ("--coordinator", self.addr, "--token-file", self.token_file)
        r = self.ctl("status", *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        rows = r.stdout.splitlines()
        self.assertEqual(rows[0].split()[:3], ["JOB", "STATE", "GEN"], r.stdout)
        self.assertEqual(sorted(tuple(row.split()[:2]) for row in rows[1:]),
                         sorted([(job1, "STOPPED"), (job0, "STOPPED"), (job2, "RUNNING")]),
                         r.stdout)
        self.assertRegex(r.stdout, r"%s +STOPPED .*/100000 .*stopped" % job1)
        r = self.ctl("status", "--json", *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        listed = {j["job_id"]: j for j in json.loads(r.stdout)}
        self.assertEqual(sorted(listed), sorted([job1, job0, job2]))
        self.assertEqual((listed[job1]["state"], listed[job2]["state"]), ("STOPPED", "RUNNING"))
        self.assertEqual(listed[job2]["steps"], 100000)
        self.assertGreaterEqual(listed[job2]["step"], 1)
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(timeout=self.GRACE_MS / 1000.0 + 5)
        self.assertEqual(rc, 0)
        self.assertFalse(proc_alive(tr2.pid))
        self.assertEqual(procs_under(work), [], "the agent left orphans")
        with open(os.path.join(self.tmp, "agent-h0.log")) as f:
            log = f.read()
        # The agent stopped the trainers itself, not PDEATHSIG: job 1's and job 2's by SIGTERM,
        # on which each saved its step and exited 3; job 0's by SIGKILL.
        for job, pid in ((job1, tr.pid), (job2, tr2.pid)):
            self.assertIn("stopping job %s rank 0 (pid %d): it saves its step first" % (job, pid),
                          log)
            self.assertIn("job %s rank 0 stopped (code 3, signal 0)" % job, log)
        self.assertIn("stopping job %s rank 0 (pid %d)\n" % (job0, tr0.pid), log)
        self.assertIn("job %s rank 0 stopped (code 0, signal %d)" % (job0, signal.SIGKILL), log)
        self.assertEqual(len(self.committed_steps(ckpt + "2")), 1)
        sys.stderr.write("[stop -> trainer gone in %.0f ms] " % gone_ms)


# ---------------------------------------------------------------------------------------------
# 7. The rendezvous key-value store and stale generations
# ---------------------------------------------------------------------------------------------

class T7_KvGenerations(ClusterTest):
    def test_kv_scoped_by_generation(self):
        # A long heartbeat: the fake node below answers no heartbeats unless told to.
        port = free_port()
        self.start_coordinator(port=port, heartbeat_ms=5000)
        info = pb.NodeInfo(hostname="fake0", devices=[pb.Device(kind="cpu", index=0, name="cpu")])
        node_id = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info)).node_id
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(
            spec=job_spec(os.path.join(self.tmp, "ck"), 10))).job_id
        j = self.get_job(job_id)
        self.assertEqual((j.state, j.generation), (pb.JOB_RENDEZVOUS, 1), j.reason)
        gen = j.generation

        def kv_get(g, key, timeout_ms=0, deadline=10):
            return self.call("KvGet", pb.KvGetRequest(job_id=job_id, generation=g, key=key,
                                                      timeout_ms=timeout_ms),
                             timeout=deadline).value

        self.call("KvPut", pb.KvPutRequest(job_id=job_id, generation=gen, key="addr/0",
                                           value=b"10.0.0.1:5000"))
        self.assertEqual(kv_get(gen, "addr/0"), b"10.0.0.1:5000")

        # A blocking get returns when another thread puts the key.
        got = {}

        def getter(key, g=gen):
            t = time.monotonic()
            try:
                got[key] = (kv_get(g, key, timeout_ms=8000), time.monotonic() - t)
            except grpc.RpcError as e:
                got[key] = (e, time.monotonic() - t)

        th = threading.Thread(target=getter, args=("nccl-id",))
        th.start()
        time.sleep(0.3)
        self.assertNotIn("nccl-id", got, "KvGet returned before the key was put")
        self.call("KvPut", pb.KvPutRequest(job_id=job_id, generation=gen, key="nccl-id",
                                           value=b"\x00\x01\xfe\xff" * 32))
        th.join(timeout=5)
        self.assertFalse(th.is_alive())
        value, took = got["nccl-id"]
        self.assertEqual(value, b"\x00\x01\xfe\xff" * 32)
        self.assertTrue(0.25 < took < 2.0, took)

        # Any other generation is stale, for gets and puts alike.
        for g in (gen - 1, gen + 1):
            with self.assertRaises(grpc.RpcError) as cm:
                kv_get(g, "addr/0")
            self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("stale", cm.exception.details())
            with self.assertRaises(grpc.RpcError) as cm:
                self.call("KvPut", pb.KvPutRequest(job_id=job_id, generation=g, key="k",
                                                   value=b"v"))
            self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION)

        # A get that times out: DEADLINE_EXCEEDED naming the key, after the wait asked for.
        t = time.monotonic()
        with self.assertRaises(grpc.RpcError) as cm:
            kv_get(gen, "never/set", timeout_ms=300)
        took = time.monotonic() - t
        self.assertCode(cm, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn("never/set", cm.exception.details())
        self.assertTrue(0.25 < took < 2.0, took)
        with self.assertRaises(grpc.RpcError) as cm:
            kv_get(gen, "never/set", timeout_ms=0)
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as cm:
            self.call("KvGet", pb.KvGetRequest(job_id="job-404", generation=1, key="k"))
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND)

        # The generation moves on (rank 0 reports a crash): a get still waiting on the old
        # generation fails FAILED_PRECONDITION, and the new generation sees none of the old keys.
        th = threading.Thread(target=getter, args=("late",))
        th.start()
        time.sleep(0.2)
        failed = pb.TrainerStatus(job_id=job_id, generation=gen, rank=0, state=pb.TRAINER_FAILED,
                                  exit_code=7, last_error="boom")
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=1, trainers=[failed]))
        th.join(timeout=5)
        self.assertFalse(th.is_alive())
        err, took = got["late"]
        self.assertIsInstance(err, grpc.RpcError)
        self.assertEqual(err.code(), grpc.StatusCode.FAILED_PRECONDITION, err.details())
        self.assertLess(took, 2.0)
        j = self.get_job(job_id)
        self.assertEqual(j.restarts, 1)
        self.assertNotEqual(j.state, pb.JOB_RUNNING)
        # The node is healthy and idle again, so the job is re-planned: generation 2.
        j = wait_until(lambda: (lambda x: x if x.generation == gen + 1 else None)(
            self.get_job(job_id)), 2, "generation %d (state now %s: %s)" % (
                gen + 1, pb.JobState.Name(j.state), j.reason))
        self.assertEqual(j.state, pb.JOB_RENDEZVOUS, j.reason)
        with self.assertRaises(grpc.RpcError) as cm:
            kv_get(gen + 1, "addr/0")
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as cm:
            kv_get(gen, "addr/0")
        self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION)
        self.call("KvPut", pb.KvPutRequest(job_id=job_id, generation=gen + 1, key="addr/0",
                                           value=b"new"))
        self.assertEqual(kv_get(gen + 1, "addr/0"), b"new")

        # The coordinator is killed and restarted in the middle of this rendezvous: the live
        # generation's keys are still there (trainers waiting on them retry and carry on).
        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait(timeout=5)
        self.start_coordinator(port=port, heartbeat_ms=5000)
        self.assertEqual(kv_get(gen + 1, "addr/0"), b"new")
        with self.assertRaises(grpc.RpcError) as cm:
            kv_get(gen, "addr/0")
        self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION)


# ---------------------------------------------------------------------------------------------
# 8. A trainer in the middle of its rendezvous rides out a coordinator restart
# ---------------------------------------------------------------------------------------------

class T8_RendezvousAcrossRestart(ClusterTest):
    def test_trainer_waits_through_a_coordinator_restart(self):
        """A dp=2 job on a real agent and a fake node that never starts its trainer: the real
        trainer posts its address and waits for its peer's. The coordinator is killed and
        restarted meanwhile: the trainer's KV calls are retried (it does not fail, the job is
        not restarted) and its key is still there."""
        port = free_port()
        self.start_coordinator(port=port)
        info = pb.NodeInfo(hostname="fake0", devices=[pb.Device(kind="cpu", index=0, name="cpu")])
        node_id = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info)).node_id
        stop = threading.Event()

        def heartbeat():  # keeps the fake node alive, through the restart too
            seq = 0
            while not stop.is_set():
                seq += 1
                try:
                    self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=seq),
                              timeout=1.0)
                except grpc.RpcError:
                    pass
                stop.wait(HEARTBEAT_MS / 2000.0)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        self.addCleanup(beat.join)
        self.addCleanup(stop.set)
        self.start_agent("h0")
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ck"), 10)
        spec.parallel.dp = 2
        spec.training.micro_batch = TINY["batch"] // 2
        spec.elastic.min_nodes = spec.elastic.max_nodes = 2
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        gen = self.wait_state(job_id, [pb.JOB_RENDEZVOUS], 10).generation

        def posted():
            for r in (0, 1):
                try:
                    return "dp/cpu/addr/%d" % r, self.call("KvGet", pb.KvGetRequest(
                        job_id=job_id, generation=gen, key="dp/cpu/addr/%d" % r)).value
                except grpc.RpcError:
                    pass
            return None

        key, value = wait_until(posted, 20, "the real trainer to post its address")
        trainers = procs_under(os.path.join(self.tmp, "work-h0"))
        self.assertEqual(len(trainers), 1, trainers)

        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait(timeout=5)
        time.sleep(0.5)  # the trainer's KV calls fail meanwhile
        self.start_coordinator(port=port)
        self.assertEqual(self.call("KvGet", pb.KvGetRequest(job_id=job_id, generation=gen,
                                                            key=key)).value, value)
        time.sleep(2.0)  # time for a trainer that gave up to exit and be reported
        logs = glob.glob(os.path.join(self.tmp, "work-h0", "**", "*.log"), recursive=True)
        self.assertTrue(proc_alive(trainers[0]), "the trainer failed during the restart:\n" +
                        "".join(tail(x) for x in logs))
        j = self.get_job(job_id)
        self.assertEqual((j.state, j.generation, j.restarts), (pb.JOB_RENDEZVOUS, gen, 0),
                         j.reason)
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))
        self.wait_state(job_id, [pb.JOB_STOPPED], 10)


    def test_checkpoint_reports_survive_a_restart(self):
        """A checkpoint step half reported when the coordinator is killed: the restarted one
        still has the first writer's report (which does not report again), and the second
        writer's report commits the step. Repeated reports get the first answer."""
        port = free_port()
        self.start_coordinator(port=port, heartbeat_ms=5000)
        info = pb.NodeInfo(hostname="fake0", devices=[
            pb.Device(kind="cpu", index=i, name="cpu") for i in (0, 1)])
        self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info))
        ckpt = os.path.join(self.tmp, "ck")
        spec = job_spec(ckpt, 10)
        spec.parallel.dp = 2
        spec.training.micro_batch = TINY["batch"] // 2
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        gen = self.wait_state(job_id, [pb.JOB_RENDEZVOUS], 10).generation
        os.makedirs(os.path.join(ckpt, "step-%08d" % 5))

        def report(rank):
            return self.call("ReportCheckpoint", pb.ReportCheckpointRequest(
                job_id=job_id, generation=gen, step=5, rank=rank, world=2, lo=100 * rank,
                hi=100 * (rank + 1), bytes=400, crc32c=7 + rank,
                name="shard-%05d.bin" % rank)).committed

        self.assertFalse(report(0))
        self.assertFalse(report(0))  # repeated (its first answer was lost): the same answer
        self.coord.send_signal(signal.SIGKILL)
        self.coord.wait(timeout=5)
        self.start_coordinator(port=port, heartbeat_ms=5000)
        self.assertTrue(report(1))
        with open(os.path.join(ckpt, "step-%08d" % 5, "MANIFEST")) as f:
            manifest = f.read()
        self.assertIn("world 2", manifest)
        self.assertIn("shard 0 0 100 400 00000007 shard-00000.bin", manifest)
        self.assertIn("shard 1 100 200 400 00000008 shard-00001.bin", manifest)
        self.assertEqual(self.get_job(job_id).committed_step, 5)
        self.assertFalse(report(1))  # repeated after the commit: nothing more to do
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))


# ---------------------------------------------------------------------------------------------
# 9. A hung rank: SIGSTOPped, named by the coordinator from the ranks' progress reports
# ---------------------------------------------------------------------------------------------

class T9_HungRank(ClusterTest):
    HANG_S = 4

    def test_stopped_trainer_is_named_and_the_job_recovers(self):
        """A dp=2 job on two nodes; rank 1's trainer is SIGSTOPped. Rank 0 blocks in the
        gradient all-reduce; within hang_timeout_s the coordinator names rank 1 and its node
        (not the waiting rank 0, as a collective timeout would, 300 s later), restarts from the
        last checkpoint, and the job completes. Meanwhile GetJob shows each rank's step and
        what it is blocked in."""
        self.start_coordinator()
        self.start_agent("h0", grace_ms=1000)
        self.start_agent("h1", grace_ms=1000)
        self.wait_nodes(2)
        steps = slow_steps(8.0)
        every = max(steps // 4, 1)
        steps = 6 * every
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=every, dp=2)
        spec.elastic.hang_timeout_s = self.HANG_S
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        # Every rank's step, once both have reported (the job's step is rank 0's).
        j = wait_until(lambda: (lambda x: x if len(x.ranks) == 2 and min(
            r.step for r in x.ranks) >= 1 else None)(self.get_job(job_id)), 20, "both ranks' steps")
        self.assertEqual([r.state for r in j.ranks], [pb.TRAINER_RUNNING] * 2)
        victim = [r for r in j.ranks if r.rank == 1][0]

        def rank1():
            for n in self.nodes():
                for t in n.trainers:
                    if t.job_id == job_id and t.rank == 1 and t.pid > 0 and t.generation == 1:
                        return n, t
            return None

        node, tr = wait_until(rank1, 10, "rank 1's trainer")
        self.assertEqual((node.node_id, node.info.hostname), (victim.node_id, victim.hostname))
        os.kill(tr.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            # While it hangs: rank 0 is blocked in the all-reduce, rank 1 is silent.
            blocked = wait_until(lambda: (lambda x: x if x.generation == 1 and any(
                r.rank == 0 and "all_reduce" in r.waiting for r in x.ranks) else None)(
                    self.get_job(job_id)), self.HANG_S, "rank 0 shown blocked in the all-reduce")
            self.assertEqual([r.waiting for r in blocked.ranks if r.rank == 1], [""])
            status = self.ctl("status", "--coordinator", self.addr, "--token-file",
                              self.token_file, "--json", job_id)
            self.assertEqual(status.returncode, 0, status.stderr)
            ranks = json.loads(status.stdout)["ranks"]
            self.assertEqual([r["rank"] for r in ranks], [0, 1])

            j = wait_until(lambda: (lambda x: x if x.generation > 1 or x.state != pb.JOB_RUNNING
                                    else None)(self.get_job(job_id)), self.HANG_S + 10,
                           "the hang to be detected")
            detected = time.monotonic() - t_stop
        finally:
            try:
                os.kill(tr.pid, signal.SIGCONT)
            except OSError:
                pass
        sys.stderr.write("[SIGSTOP -> rank named in %.1f s, hang_timeout_s %d] "
                         % (detected, self.HANG_S))
        self.assertLess(detected, self.HANG_S + 6)
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        m = re.search(r"job %s: RUNNING -> RECOVERING \(generation 1\): hang: (.*)" % job_id, log)
        self.assertIsNotNone(m, log[-3000:])
        self.assertRegex(m.group(1), r"rank 0 has waited [\d.]+ s in world all_reduce #\d+; "
                         r"rank 1 sent no report for [\d.]+ s \(stopped or wedged\); named: "
                         r"rank 1 on %s \(%s\)" % (victim.node_id, victim.hostname))
        self.assertNotIn("rank 0 on", m.group(1))
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.step, done.world_size), (1, steps, 2))
        wait_until(lambda: not proc_alive(tr.pid), 10, "the stopped trainer to be killed")


def uninterrupted_losses(tmp, job_id, world, extra):
    """{step: loss} of the job's ranks' own command line (generation 1's, from the log of its
    rank 0, on whichever node), run uninterrupted by `world` processes with the extra flags."""
    lines = []
    for log in glob.glob(os.path.join(tmp, "work-*", job_id, "rank-0.log")):
        with open(log) as f:
            lines += [x for x in f if x.startswith("==== job %s generation 1 " % job_id)]
    args = lines[0].split(": ", 1)[1].split()
    for flag, value in (("--ckpt-dir", tmp + "/ref"), ("--save-every", "0")):
        args[args.index(flag) + 1] = value
    ref_metrics = os.path.join(tmp, "ref.jsonl")
    procs = [subprocess.Popen(args + extra + ["--metrics", ref_metrics, "--quiet"],
                              env=dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world),
                                       RANK=str(r), DISTRAIN_KV_DIR=tmp + "/ref-kv"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for r in range(world)]
    assert [p.wait(timeout=120) for p in procs] == [0] * world, "the reference run failed"
    with open(ref_metrics) as f:
        return {m["step"]: m["loss"] for m in map(json.loads, f) if "loss" in m}


class T10_NonFinite(ClusterTest):
    def test_nan_rolls_back_and_skips_the_batch(self):
        """A dp=2 job whose loss turns NaN at step F (fault injection on every trainer:
        DISTRAIN_FAULT_NAN_STEP): every rank stops before the update, the coordinator records F
        as skipped and restarts from the last checkpoint; the new generation takes step F
        without an update and completes. Its losses equal those of an uninterrupted
        dp=2 run with --skip-steps F, so the rollback lost nothing."""
        self.start_coordinator()
        steps = slow_steps(4.0)
        every = max(steps // 4, 2)
        steps, fault = 4 * every, every + every // 2
        self.env["DISTRAIN_FAULT_NAN_STEP"] = str(fault)
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=every, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.generation, list(done.skipped_steps)),
                         (1, 2, [fault]))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: RUNNING -> RECOVERING \(generation 1\): rank \d "
                             r"on node-\d: the loss or gradient norm of step %d was non-finite; "
                             r"rolling back, that step's batch will be skipped \(1 step skipped "
                             r"so far\); restart 1 of 3 from the last committed checkpoint"
                             % (job_id, fault))
        status = self.ctl("status", job_id, "--json", "--coordinator", self.addr, "--token-file",
                          self.token_file)
        self.assertEqual(json.loads(status.stdout)["skipped_steps"], [fault])
        self.assertUninterrupted(job_id, steps, 2, skipped=(fault,))


class T10b_LossSpike(ClusterTest):
    def spike_job(self, **elastic):
        """A dp=2 job on two agents with elastic.spike_factor 3 (and the elastic fields given)
        on test_spike's data, whose step SPIKE is random tokens: its id and final Job."""
        import test_spike as spike  # numpy: imported here, as only these tests need it
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        shard = os.path.join(self.tmp, "spiky.bin")
        spike.write_spiky_shard(shard, spike.SPIKE)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), spike.STEPS, every=20, dp=2)
        spec.data.train, spec.data.val = shard, ""
        spec.optimizer.lr = 1e-2
        spec.elastic.spike_factor = 3
        for k, v in elastic.items():
            setattr(spec.elastic, k, v)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        return job_id, self.wait_state(job_id, [pb.JOB_COMPLETED], 120)

    def test_loss_spike_rolls_back_and_skips_the_batch(self):
        """A dp=2 job with elastic.spike_factor 3 and spike_skip 3 on data whose step S is
        random tokens (test_spike's): every rank stops before that step's update, the
        coordinator records S, S+1 and S+2 as skipped, names the spike and restarts from the
        last checkpoint (its trainers told --skip-steps S:3); the job completes with the losses
        of an uninterrupted run with --skip-steps S,S+1,S+2, bit for bit."""
        import test_spike as spike
        job_id, done = self.spike_job(spike_skip=3)
        window = [spike.SPIKE, spike.SPIKE + 1, spike.SPIKE + 2]
        self.assertEqual((done.restarts, done.generation, list(done.skipped_steps)),
                         (1, 2, window))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: RUNNING -> RECOVERING \(generation 1\): rank \d "
                             r"on node-\d: the loss of step %d spiked \(over "
                             r"elastic.spike_factor x the recent steps' average\); rolling back, "
                             r"the batches of steps %d-%d \(elastic.spike_skip\) will be skipped "
                             r"\(3 steps skipped so far\); restart 1 of 3 from the last committed "
                             r"checkpoint" % (job_id, spike.SPIKE, spike.SPIKE, spike.SPIKE + 2))
        status = self.ctl("status", job_id, "--coordinator", self.addr, "--token-file",
                          self.token_file)
        self.assertIn("skipped:     steps %d-%d (a non-finite or spiking loss or gradient norm)"
                      % (spike.SPIKE, spike.SPIKE + 2), status.stdout)
        self.assertUninterrupted(job_id, spike.STEPS, 2, skipped=tuple(window))

    def test_gradient_norm_spike_rolls_back(self):
        """elastic.grad_spike_factor 3 alone: the spike's gradient norm rolls the job back the
        same way, the coordinator naming it; the losses of --skip-steps S."""
        import test_spike as spike
        job_id, done = self.spike_job(spike_factor=0, grad_spike_factor=3)
        self.assertEqual((done.restarts, done.generation, list(done.skipped_steps)),
                         (1, 2, [spike.SPIKE]))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: RUNNING -> RECOVERING \(generation 1\): rank \d "
                             r"on node-\d: the gradient norm of step %d spiked \(over "
                             r"elastic.grad_spike_factor x the recent steps' average\); rolling "
                             r"back, that step's batch will be skipped" % (job_id, spike.SPIKE))
        self.assertUninterrupted(job_id, spike.STEPS, 2, skipped=(spike.SPIKE,))

    def test_loss_spike_skipped_in_place(self):
        """The same job with elastic.bad_step: skip (spike_skip 2): no restart; the ranks take
        steps S and S+1 without an update where they are, the coordinator records them as
        skipped and says so; the losses are those of an uninterrupted run with --skip-steps
        S,S+1, bit for bit."""
        import test_spike as spike
        job_id, done = self.spike_job(spike_skip=2, bad_step="skip")
        window = [spike.SPIKE, spike.SPIKE + 1]
        self.assertEqual((done.restarts, done.generation, list(done.skipped_steps)),
                         (0, 1, window))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        self.assertRegex(log, r"job %s: rank \d on node-\d took steps %d-%d without an update, "
                         r"where it was \(a non-finite or spiking loss; elastic.bad_step: skip\)"
                         % (job_id, spike.SPIKE, spike.SPIKE + 1))
        self.assertEqual(len(re.findall(r"took steps %d-%d without" % tuple(window), log)), 1,
                         "said once, whichever rank reported first")
        self.assertUninterrupted(job_id, spike.STEPS, 2, skipped=tuple(window))


class T10c_StopSignal(ClusterTest):
    def test_trainer_stopped_by_a_signal_saves_its_step(self):
        """SIGTERM to one trainer of a dp=2 job (what a scheduler preempting its node sends):
        both ranks stop after the same step and commit it, the job restarts from that step
        without counting a restart, and its losses are the uninterrupted run's, bit for bit."""
        self.start_coordinator()
        steps = slow_steps(4.0)
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=0, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        _, tr = self.trainer_of(job_id)
        os.kill(tr.pid, signal.SIGTERM)
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.generation), (0, 2))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            m = re.search(r"job %s: RUNNING -> RECOVERING \(generation 1\): rank %d on node-\d "
                          r"exited with code 3: stopped on request after a step, its checkpoint "
                          r"committed; restarting from checkpoint step (\d+), not counted "
                          r"against max_restarts" % (job_id, tr.rank), f.read())
        self.assertTrue(m, "the coordinator's log has no uncounted restart")
        stopped = int(m.group(1))
        self.assertTrue(0 < stopped < steps, stopped)
        self.assertUninterrupted(job_id, steps, 2)

    def test_agent_stopped_mid_job(self):
        """SIGTERM to the agent running rank 0 of a dp=2 job (systemctl stop on a node being
        drained), a spare node registered: the job's trainers save their step on both nodes,
        the job goes on on the other node and the spare from that step, uncounted, with the
        uninterrupted losses, and rank 0's last steps on the drained node are not lost."""
        self.start_coordinator()
        steps = slow_steps(4.0)
        for h in ("h0", "h1"):
            self.start_agent(h)
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=0, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        self.start_agent("h2")
        self.wait_nodes(3)
        drained = [n.info.hostname for n in self.nodes() for t in n.trainers
                   if t.job_id == job_id and t.rank == 0][0]
        kept = "h1" if drained == "h0" else "h0"
        self.agents[drained].send_signal(signal.SIGTERM)
        self.assertEqual(self.agents[drained].wait(timeout=15), 0)
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        # The agent said it was leaving before it stopped its trainers: the new generation
        # went to h0 and the spare at once, and no restart was counted.
        self.assertEqual((done.restarts, done.generation), (0, 2))
        ids = {n.info.hostname: n.node_id for n in self.nodes()}
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        self.assertIn("node %s (%s) is leaving: its agent is stopping" % (ids[drained], drained),
                      log)
        self.assertRegex(log, r"exited with code 3: stopped on request after a step, its "
                         r"checkpoint committed; restarting from checkpoint step \d+, not "
                         r"counted against max_restarts")
        placed = re.search(r"RECOVERING -> RENDEZVOUS \(generation 2\): .* on (\S+),", log)
        self.assertEqual(sorted(placed.group(1).split(",")), sorted([ids[kept], ids["h2"]]))
        self.assertUninterrupted(job_id, steps, 2)


class T10d_Drain(ClusterTest):
    def test_drain_moves_the_job_and_loses_nothing(self):
        """distrainctl drain (by hostname) on the node running rank 0 of a dp=2 job, a spare
        registered: the trainers save their step and stop, --wait returns once they have, and
        the job goes on on the other node and the spare from that step, uncounted, with the
        uninterrupted losses. The drained node, its agent still running, gets no work (a job
        needing it waits, saying so) until it is undrained."""
        self.start_coordinator()
        steps = slow_steps(4.0)
        for h in ("h0", "h1", "h2"):
            self.start_agent(h)
        self.wait_nodes(3)
        common = ("--coordinator", self.addr, "--token-file", self.token_file)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=0, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        ids = {n.info.hostname: n.node_id for n in self.nodes()}
        drained = [n.info.hostname for n in self.nodes() for t in n.trainers
                   if t.job_id == job_id and t.rank == 0][0]
        kept = [n.info.hostname for n in self.nodes() for t in n.trainers
                if t.job_id == job_id and t.rank == 1][0]
        spare = ({"h0", "h1", "h2"} - {drained, kept}).pop()
        # A follower polling every 2 s: the restart falls between two polls, and it still
        # prints the RECOVERING state the job went through, with its cause.
        watch = subprocess.Popen([binary("coordinator", "distrainctl"), "status", job_id,
                                  "--watch"] + list(common), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(self.env, DISTRAIN_CTL_POLL_MS="2000"))
        time.sleep(0.5)
        # --timeout 0: the trainers are still there when the drain is answered (exit 3, the
        # node drained); then --wait until they have saved their step and gone
        r = self.ctl("drain", drained, "--reason", "swap a DIMM", "--wait", "--timeout", "0",
                     *common)
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertIn("%s still runs trainers after 0 s; it stays drained" % ids[drained],
                      r.stderr)
        r = self.ctl("drain", drained, "--reason", "swap a DIMM", "--wait", *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"\n%s +%s +DRAINED .*  \[drained: swap a DIMM\]\n$"
                         % (ids[drained], drained))
        self.assertFalse([t for n in self.nodes() if n.info.hostname == drained
                          for t in n.trainers if t.state == pb.TRAINER_RUNNING])
        self.assertIsNone(self.agents[drained].poll(), "the drained node's agent exited")
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.generation), (0, 2))
        self.assertEqual(watch.wait(timeout=30), 0)
        recovering = [x for x in watch.stderr.read().splitlines() if "RECOVERING" in x]
        self.assertEqual(len(recovering), 1, recovering)
        self.assertRegex(recovering[0], r"^\[%s\] RECOVERING \(generation 1\): rank \d on "
                         r"node-\d exited with code 3: .*; restarting from checkpoint step \d+"
                         % job_id)
        self.assertIn("restarted:   " + done.last_restart,
                      self.ctl("status", job_id, *common).stdout)
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        self.assertIn("node %s (%s) drained: no new work goes there (reason: swap a DIMM)"
                      % (ids[drained], drained), log)
        self.assertRegex(log, r"exited with code 3: stopped on request after a step, its "
                         r"checkpoint committed.*; restarting from checkpoint step \d+, not "
                         r"counted against max_restarts")
        placed = re.search(r"RECOVERING -> RENDEZVOUS \(generation 2\): .* on (\S+),", log)
        self.assertEqual(sorted(placed.group(1).split(",")), sorted([ids[kept], ids[spare]]))
        self.assertUninterrupted(job_id, steps, 2)

        # A job that needs all three nodes waits for the drained one, and says why.
        spec3 = job_spec(os.path.join(self.tmp, "ckpt3"), 5, shape=dict(TINY, batch=6), dp=3)
        spec3.elastic.min_nodes = 3
        job3 = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec3)).job_id
        wait_until(lambda: "(1 drained: distrainctl undrain)" in self.get_job(job3).reason, 10,
                   "the job to wait for the drained node")
        self.assertEqual(self.get_job(job3).state, pb.JOB_PENDING)
        listed = {n["hostname"]: n for n in json.loads(self.ctl("nodes", "--json", *common).stdout)}
        self.assertEqual((listed[drained]["state"], listed[drained]["drain_reason"]),
                         ("DRAINED", "swap a DIMM"))
        r = self.ctl("undrain", ids[drained], *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"\n%s +%s +ALIVE " % (ids[drained], drained))
        self.assertEqual(self.wait_state(job3, [pb.JOB_COMPLETED], 60).world_size, 3)

        # Bad input: an unknown node, a hostname two nodes share, a reason that is not one
        # short line, a reason for undrain.
        r = self.ctl("drain", "nope", *common)
        self.assertEqual(r.returncode, 1)
        self.assertIn("no node 'nope': neither a node id nor a registered node's hostname",
                      r.stderr)
        info = pb.NodeInfo(hostname=kept, devices=[pb.Device(kind="cpu")])
        twin = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info)).node_id
        r = self.ctl("drain", kept, *common)
        self.assertEqual(r.returncode, 1)
        self.assertIn("hostname '%s' names 2 nodes (%s, %s): give a node id"
                      % (kept, ids[kept], twin), r.stderr)
        # Once the twin is dead (it sends no heartbeat), the hostname names the alive node.
        wait_until(lambda: [n for n in self.nodes() if n.node_id == twin][0].state ==
                   pb.NODE_DEAD, 10, "the twin to be declared dead")
        r = self.ctl("drain", kept, *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stdout, r"\n%s +%s +DRAINED " % (ids[kept], kept))
        self.assertEqual(self.ctl("undrain", ids[kept], *common).returncode, 0)
        r = self.ctl("undrain", kept, "--reason", "x", *common)
        self.assertEqual(r.returncode, 2)
        for reason, why in (("a\nb", "one line of text"), ("x" * 201, "at most 200")):
            with self.assertRaises(grpc.RpcError) as cm:
                self.call("DrainNode", pb.DrainNodeRequest(node=twin, reason=reason))
            self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(why, cm.exception.details())
        self.assertFalse([n for n in self.nodes() if n.drained])

    def test_drain_outlives_an_agent_restart(self):
        """A restarted agent registers as the node it was (its work directory keeps the id), so
        a drained node stays drained through a reboot, with no second node for the same host;
        an agent of another host asking for that id becomes a node of its own."""
        self.start_coordinator()
        agent = self.start_agent("h0")
        self.wait_nodes(1)
        common = ("--coordinator", self.addr, "--token-file", self.token_file)
        node = self.nodes()[0].node_id
        self.assertEqual(self.ctl("drain", "h0", "--reason", "reboot", *common).returncode, 0)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=5)
        self.start_agent("h0")
        with open(os.path.join(self.tmp, "work-h0", "node-id")) as f:
            self.assertEqual(f.read(), node + "\n")
        wait_until(lambda: read_text(os.path.join(self.tmp, "agent-h0.log")).count(
            "registered as %s with" % node) == 2, 10, "the agent to register again")
        nodes = self.nodes()
        self.assertEqual([(n.node_id, n.drained, n.drain_reason) for n in nodes],
                         [(node, True, "reboot")])
        spec = job_spec(os.path.join(self.tmp, "ckpt"), 5)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        wait_until(lambda: "(1 drained: distrainctl undrain)" in self.get_job(job_id).reason, 10,
                   "the job to wait for the drained node")
        self.assertEqual(self.ctl("undrain", node, *common).returncode, 0)
        self.assertEqual(self.wait_state(job_id, [pb.JOB_COMPLETED], 30).failed_nodes, [])
        info = pb.NodeInfo(hostname="other", devices=[pb.Device(kind="cpu")])
        other = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info, node_id=node))
        self.assertNotEqual(other.node_id, node)
        self.assertEqual(sorted(n.info.hostname for n in self.nodes()), ["h0", "other"])


class T10h_Priority(ClusterTest):
    def test_higher_priority_job_preempts_and_nothing_is_lost(self):
        """A dp=2 job of priority 0 on both nodes; a job of elastic.priority 5 that needs both
        is submitted: the first is preempted (its trainers save their step and stop), the
        second runs to the end on its nodes, then the first resumes from the step it saved,
        uncounted, with the uninterrupted losses bit for bit. A job of equal priority waits."""
        self.start_coordinator()
        steps = slow_steps(4.0)
        for h in ("h0", "h1"):
            self.start_agent(h)
        self.wait_nodes(2)
        common = ("--coordinator", self.addr, "--token-file", self.token_file)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=0, dp=2)
        low = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(low, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        same = job_spec(os.path.join(self.tmp, "ckpt_same"), 3)
        same = self.call("SubmitJob", pb.SubmitJobRequest(spec=same)).job_id
        hi = job_spec(os.path.join(self.tmp, "ckpt_hi"), 5, shape=dict(TINY, batch=8), dp=2)
        hi.elastic.min_nodes, hi.elastic.priority = 2, 5
        hi = self.call("SubmitJob", pb.SubmitJobRequest(spec=hi)).job_id
        self.assertEqual(self.wait_state(hi, [pb.JOB_COMPLETED], 60).world_size, 2)
        self.assertIn("job:         %s  py  (elastic.priority 5)" % hi,
                      self.ctl("status", hi, *common).stdout)
        done = self.wait_state(low, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.generation), (0, 2))
        self.assertRegex(done.last_restart, r"rank \d on node-\d exited with code 3: .* \(preempted "
                         r"by %s\); restarting from checkpoint step \d+, not counted" % hi)
        self.assertUninterrupted(low, steps, 2)
        self.assertEqual(self.wait_state(same, [pb.JOB_COMPLETED], 60).restarts, 0)
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            log = f.read()
        self.assertIn("job %s preempted by %s (elastic.priority 5 over 0): its trainers save "
                      "their step and stop" % (low, hi), log)
        # the waiting jobs in order: the preemptor first, then the one preempted (submitted
        # first), then the one of equal priority
        order = re.findall(r"job (job-\d+): (?:PENDING|RECOVERING) -> RENDEZVOUS", log)
        self.assertEqual(order, [low, hi, low, same])


class T10e_Resume(ClusterTest):
    def test_stopped_job_resumes_where_it_stopped(self):
        """distrainctl stop, then distrainctl resume at once: resume waits while the trainer
        still saves the step it was stopped at (SIGSTOPped here until 1.5 s later), then the
        job goes on from that step under its id, and its losses are the uninterrupted run's."""
        self.start_coordinator()
        self.start_agent("h0")
        self.wait_nodes(1)
        common = ("--coordinator", self.addr, "--token-file", self.token_file)
        steps = slow_steps(3.0)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, every=0)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        _, tr = self.trainer_of(job_id)
        os.kill(tr.pid, signal.SIGSTOP)
        r = self.ctl("stop", job_id, *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        threading.Timer(1.5, os.kill, (tr.pid, signal.SIGCONT)).start()
        t = time.monotonic()
        r = self.ctl("resume", job_id, *common)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertGreater(time.monotonic() - t, 1.0)
        self.assertIn("%s's trainers are still saving the step it was stopped at; try again once "
                      "they have exited; waiting" % job_id, r.stderr)
        self.assertRegex(r.stdout, r"restarted: +resumed by the user \(it was STOPPED\); "
                         r"restarting from checkpoint step \d+")
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        self.assertEqual((done.restarts, done.generation), (0, 2))
        self.assertUninterrupted(job_id, steps, 1)
        r = self.ctl("resume", job_id, *common)
        self.assertEqual(r.returncode, 1)
        self.assertIn("job %s is COMPLETED: only a STOPPED or FAILED job can be resumed" % job_id,
                      r.stderr)


class T10g_CheckpointDiskFull(ClusterTest):
    def test_save_on_a_full_disk_is_skipped_and_the_job_trains_on(self):
        """A dp=2 ZeRO-1 job (two writers) whose rank on h0 finds its disk full saving step F
        (DISTRAIN_FAULT_NOSPACE_STEP on that agent): the coordinator abandons the step (the
        other writer's shard deleted, no manifest) and says so in its log, the job's
        checkpoint_error and /metrics; the job trains on in its first generation, the next
        save commits and clears the error, and every loss is the uninterrupted run's."""
        hport_file = os.path.join(self.tmp, "http.port")
        self.start_coordinator(args=["--http", "127.0.0.1:0", "--http-port-file", hport_file])
        steps = slow_steps(6.0)
        every = max(steps // 4, 2)
        steps, fault = 4 * every, 3 * every
        self.start_agent("h0", env={"DISTRAIN_FAULT_NOSPACE_STEP": str(fault)})
        self.start_agent("h1")
        self.wait_nodes(2)
        ckpt = os.path.join(self.tmp, "ckpt")
        spec = job_spec(ckpt, steps, shape=SLOW, every=every, dp=2)
        spec.parallel.zero_stage = 1
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        j = wait_until(lambda: (lambda x: x if x.checkpoint_error or x.state == pb.JOB_COMPLETED
                                else None)(self.get_job(job_id)), 120, "the abandoned step")
        self.assertRegex(j.checkpoint_error, r"^step %d not saved: rank \d on \S+ could not write "
                         r"its shard: no space left on device in %s \([\d.]+ MiB free, the shard "
                         r"needs [\d.]+ MiB\)$" % (fault, re.escape(ckpt)))
        self.assertEqual(j.committed_step, 2 * every)
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual((done.restarts, done.generation, done.committed_step), (0, 1, steps))
        self.assertEqual(done.checkpoint_error, "")
        self.assertEqual(sorted(os.listdir(ckpt)), ["step-%08d" % s for s in
                                                    (every, 2 * every, steps)])
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: checkpoint step %d not saved: rank \d on \S+ "
                             r"could not write its shard: .*; it trains on from its last committed "
                             r"step %d" % (job_id, fault, 2 * every))
        port = int(read_text(hport_file).strip())
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
            self.assertIn('distrain_checkpoint_failures_total{job_id="%s"} 1\n' % job_id,
                          r.read().decode())
        self.assertUninterrupted(job_id, steps, 2)

    def test_last_save_on_a_full_disk_fails_the_job(self):
        """The last step's save finds h1's disk full in a dp=2 ZeRO-1 job that does not wait
        for room (checkpoint.last_save_wait_s -1): the job fails at once, not restarted (a
        restart would train to the same full disk), naming the disk and the step it resumes
        from. Both ranks say so, h0's too, which wrote its shard and learns it from the other."""
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1", env={"DISTRAIN_FAULT_NOSPACE_STEP": "8"})
        self.wait_nodes(2)
        ckpt = os.path.join(self.tmp, "ckpt")
        spec = job_spec(ckpt, 8, every=4, dp=2)
        spec.parallel.zero_stage = 1  # two writers
        spec.checkpoint.last_save_wait_s = -1
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        j = self.wait_state(job_id, [pb.JOB_FAILED], 60)
        self.assertEqual((j.restarts, j.generation, j.committed_step), (0, 1, 4))
        self.assertRegex(j.checkpoint_error, r"^step 8 not saved: rank \d on \S+ could not "
                         r"write its shard")
        self.assertRegex(j.reason, r"rank \d on node-\d exited with code 1: .*the run's last "
                         r"checkpoint, of step 8, was not saved \(a writer's disk is full\).* "
                         r"Free space in %s and resume it \(--resume; distrainctl resume JOB\) "
                         r"from step 4, the newest committed \(the job's input or configuration: "
                         r"not restarted\)" % re.escape(ckpt))
        self.assertEqual(sorted(os.listdir(ckpt)), ["step-00000004"])
        for r in (0, 1):
            log = read_text(glob.glob(os.path.join(self.tmp, "work-*", job_id,
                                                   "rank-%d.log" % r))[0])
            self.assertIn("the run's last checkpoint, of step 8, was not saved", log)

    def test_last_save_on_a_full_disk_waits_for_room(self):
        """The last step's save finds the disk full (its first write only, so that room comes
        at once): by default the trainer waits for room and writes the step again, and the job
        completes with it committed, its checkpoint_error cleared."""
        self.start_coordinator()
        self.start_agent("h0", env={"DISTRAIN_FAULT_NOSPACE_STEP": "8"})
        self.wait_nodes(1)
        ckpt = os.path.join(self.tmp, "ckpt")
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=job_spec(ckpt, 8, every=4))
                           ).job_id
        j = self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        self.assertEqual((j.restarts, j.generation, j.committed_step), (0, 1, 8))
        self.assertEqual(j.checkpoint_error, "")
        self.assertEqual(self.committed_steps(ckpt), [4, 8])
        log = read_text(glob.glob(os.path.join(self.tmp, "work-*", job_id, "rank-0.log"))[0])
        self.assertIn("the run's last checkpoint, of step 8, was not saved (a writer's disk is "
                      "full): waiting up to 600 s for room in %s" % ckpt, log)
        self.assertRegex(log, r"the run's last checkpoint, of step 8, is saved: written again "
                         r"after \d+ s")


class T10f_ClusterStopped(ClusterTest):
    def test_every_daemon_stopped_at_once_then_started_again(self):
        """SIGTERM to the coordinator and both agents of a dp=2 job at once (a plain scancel, a
        preempted allocation): the coordinator waits while the trainers save their step, so it
        is committed. Started again (the agents as new nodes), the cluster resumes the job from
        that step on them, plans nothing on the nodes that left, and the job's losses are the
        uninterrupted run's."""
        port = free_port()
        self.start_coordinator(port=port)
        for h in ("h0", "h1"):
            self.start_agent(h)
        self.wait_nodes(2)
        steps = slow_steps(4.0)
        ckpt = os.path.join(self.tmp, "ckpt")
        spec = job_spec(ckpt, steps, shape=SLOW, every=0, dp=2)
        spec.elastic.min_nodes = 2  # not dp 1 on the first agent back (the same losses, not bits)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 30, min_step=steps // 4)
        # An idle node whose agent has said it is leaving (a fake one: no agent behind it).
        info = pb.NodeInfo(hostname="gone", devices=[pb.Device(kind="cpu")])
        gone = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info)).node_id
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=gone, leaving=True))
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=gone, leaving=True, gone=True))
        daemons = [self.coord, self.agents["h0"], self.agents["h1"]]
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        self.assertEqual([p.wait(timeout=30) for p in daemons], [0, 0, 0])
        rank0 = read_text(glob.glob(os.path.join(self.tmp, "work-*", job_id, "rank-0.log"))[0])
        stopped = re.search(r"stopped on request after step (\d+) of %d" % steps, rank0)
        self.assertTrue(stopped, rank0[-2000:])
        self.assertEqual(self.committed_steps(ckpt), [int(stopped.group(1))])
        self.assertIn("signal 15: shutting down once the trainers of leaving or drained nodes "
                      "have saved their step",
                      read_text(os.path.join(self.tmp, "coordinator.log")))

        self.start_coordinator(port=port)
        for h in ("h0", "h1"):
            self.start_agent(h)
        self.assertTrue([n for n in self.nodes() if n.node_id == gone][0].leaving)
        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        self.assertEqual(done.restarts, 0, done.last_restart)
        self.assertUninterrupted(job_id, steps, 2)


class T10b_InputError(ClusterTest):
    def test_missing_data_fails_the_job_without_restarts(self):
        """A job whose training data does not exist on the node: the trainer reports an input
        error and the job FAILS at once with the trainer's reason, instead of burning its
        max_restarts on the same error."""
        self.start_coordinator()
        self.start_agent("h0")
        self.wait_nodes(1)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), 10)
        spec.data.train = os.path.join(self.tmp, "missing", "train_*.bin")
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        j = self.wait_state(job_id, [pb.JOB_FAILED], 30)
        self.assertEqual((j.restarts, j.generation), (0, 1))
        self.assertRegex(j.reason, r"rank 0 on node-\d exited with code 1: .*missing/"
                         r"train_\*\.bin: no token shard matches this path or pattern \(the job's "
                         r"input or configuration: not restarted\)")


class T11_Straggler(ClusterTest):
    def test_slow_rank_is_reported_not_restarted(self):
        """A dp=2 job where one node's trainer takes 40 ms longer per step
        (DISTRAIN_FAULT_SLOW_MS on that agent): the coordinator reports that rank, and only
        it, as a straggler in status and its log, and the job goes on in its first
        generation."""
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1", env={"DISTRAIN_FAULT_SLOW_MS": "40"})
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), 100000, shape=SLOW, every=0, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        j = wait_until(lambda: (lambda x: x if any(r.straggler for r in x.ranks) else None)(
            self.get_job(job_id)), 20, "a straggler to be reported")
        slow = [r for r in j.ranks if r.straggler]
        self.assertEqual([r.hostname for r in slow], ["h1"])
        fast = [r for r in j.ranks if not r.straggler][0]
        self.assertGreater(slow[0].compute_ms, fast.compute_ms + 30)
        self.assertEqual((j.state, j.generation, j.restarts), (pb.JOB_RUNNING, 1, 0))
        with open(os.path.join(self.tmp, "coordinator.log")) as f:
            self.assertRegex(f.read(), r"job %s: rank %d on %s \(h1\) is a straggler: [\d.]+ ms of "
                             r"compute per step, the median rank [\d.]+ ms \(reported, not "
                             r"restarted\)" % (job_id, slow[0].rank, slow[0].node_id))
        status = self.ctl("status", job_id, "--coordinator", self.addr, "--token-file",
                          self.token_file)
        self.assertRegex(status.stdout, r"%d\s+%s \(h1\).*STRAGGLER" % (slow[0].rank,
                                                                        slow[0].node_id))
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))

    def straggler_job(self, min_nodes):
        """The job above with elastic.straggler_drain_s 2, on h0 and a slow h1, running."""
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1", env={"DISTRAIN_FAULT_SLOW_MS": "40"})
        self.wait_nodes(2)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), 100000, shape=SLOW, every=0, dp=2)
        spec.elastic.straggler_drain_s = 2
        spec.elastic.min_nodes = min_nodes
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        return job_id

    def test_straggler_node_drained_where_the_job_runs_faster(self):
        """elastic.straggler_drain_s 2 and a spare node (h2, registered once the job runs on h0
        and h1): 2 s after h1's rank is reported a straggler, h1 is drained with the reason; the
        job saves its step and goes on at dp 2 on h0 and h2, the restart not counted."""
        job_id = self.straggler_job(min_nodes=1)
        self.start_agent("h2")
        self.wait_nodes(3)
        h1 = wait_until(lambda: [n for n in self.nodes() if n.info.hostname == "h1" and
                                 n.drained], 30, "h1 drained")[0]
        self.assertRegex(h1.drain_reason, r"^straggler: rank \d of job %s, [\d.]+x the median "
                         r"rank's compute for 2 s \(elastic.straggler_drain_s\); the job runs "
                         r"faster without it at dp 2 of 2$" % job_id)
        j = wait_until(lambda: (lambda x: x if x.generation == 2 and x.state == pb.JOB_RUNNING
                                else None)(self.get_job(job_id)), 30, "generation 2 running")
        self.assertEqual(sorted(r.hostname for r in j.ranks), ["h0", "h2"])
        self.assertEqual(j.restarts, 0)  # (its cause: whichever rank's stop came first)
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))

    def test_straggler_node_stays_where_the_job_needs_it(self):
        """The same with elastic.min_nodes 2 and no spare node: the job cannot run without h1,
        so h1 stays, and the coordinator's log says why."""
        job_id = self.straggler_job(min_nodes=2)
        log = os.path.join(self.tmp, "coordinator.log")
        line = wait_until(lambda: re.search(r".*its node stays.*", tail(log)), 30,
                          "the straggler judged").group(0)
        self.assertRegex(line, r"job %s: rank \d on node-\d \(h1\) has been a straggler for 2 s "
                         r"\(elastic.straggler_drain_s\), [\d.]+x the median rank's compute; its "
                         r"node stays: the job runs at 1/[\d.]+ of its pace with it, it cannot be "
                         r"placed without it$" % job_id)
        self.assertFalse(any(n.drained for n in self.nodes()))
        j = self.get_job(job_id)
        self.assertEqual((j.state, j.generation), (pb.JOB_RUNNING, 1))
        self.call("StopJob", pb.StopJobRequest(job_id=job_id))


# ---------------------------------------------------------------------------------------------
# 12. A GPU node's devices and usage, from its heartbeats to distrainctl nodes
# ---------------------------------------------------------------------------------------------

class T12_GpuUsage(ClusterTest):
    def test_gpu_usage_reaches_distrainctl(self):
        """A Python client stands in for a GPU node's agent: the devices it registers and the
        usage each heartbeat carries are what ListNodes and distrainctl nodes show; the newest
        heartbeat's usage replaces the last, and a dead node's is not shown; a GPU reporting
        uncorrected ECC errors drains the node until a heartbeat without them. The link error
        rates of an agent that does not send them (one older than they are) are unknown (-1),
        not 0 errors."""
        self.start_coordinator()
        gib = 1 << 30
        name = "NVIDIA H100 80GB HBM3"
        info = pb.NodeInfo(hostname="gpu-a", agent_version="test", devices=[
            pb.Device(kind="cuda", index=i, name=name, memory_bytes=80 * gib) for i in range(2)])
        node_id = self.call("RegisterWorker", pb.RegisterWorkerRequest(node=info)).node_id
        usage = [pb.DeviceUsage(index=0, memory_used_bytes=12 * gib, memory_total_bytes=80 * gib,
                                utilization_pct=90),
                 pb.DeviceUsage(index=1, memory_used_bytes=4 * gib, memory_total_bytes=80 * gib,
                                utilization_pct=-1, link_rates=True)]
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=1, devices=usage))
        [n] = self.nodes()
        listed = [pb.DeviceUsage() for _ in usage]
        for u, v in zip(usage, listed):
            v.CopyFrom(u)
            if not u.link_rates:  # sent by an agent older than them
                v.pcie_replays_per_min = v.nvlink_replays_per_min = v.nvlink_crc_per_min = -1
        self.assertEqual(list(n.usage), listed)

        args = ["--coordinator", self.addr, "--token-file", self.token_file]
        r = self.ctl("nodes", "--json", *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        [j] = json.loads(r.stdout)
        self.assertEqual(j["devices"], [{"kind": "cuda", "index": i, "name": name,
                                         "memory_bytes": 80 * gib} for i in range(2)])
        # (an agent that reports no health, as one older than the fields: healthy; its link
        # rates unknown)
        healthy = {"lost": False, "ecc_uncorrected": 0, "reset_pending": False,
                   "remap_failed": False, "xid": 0, "nvlink_down": 0, "pcie_width": 0,
                   "pcie_max_width": 0, "slowdown": ""}
        rates = {k: -1 for k in ("pcie_replays_per_min", "nvlink_replays_per_min",
                                 "nvlink_crc_per_min")}
        self.assertEqual(j["usage"], [
            {"index": 0, "memory_used_bytes": 12 * gib, "memory_total_bytes": 80 * gib,
             "utilization_pct": 90} | healthy | rates,
            {"index": 1, "memory_used_bytes": 4 * gib, "memory_total_bytes": 80 * gib,
             "utilization_pct": -1} | healthy | {k: 0 for k in rates}])
        self.assertEqual((j["gpu_problems"], j["drained"]), ("", False))
        r = self.ctl("nodes", *args)
        self.assertIn("2x %s, mem 16.0/160.0 GiB, util 90%%" % name, r.stdout)

        # A GPU's uncorrected ECC errors drain the node from that heartbeat on; its next
        # heartbeat without them lifts the drain.
        sick = [pb.DeviceUsage(index=1, memory_used_bytes=1, memory_total_bytes=80 * gib,
                               utilization_pct=-1, ecc_uncorrected=3)]
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=2, devices=sick))
        [n] = self.nodes()
        self.assertTrue(n.drained)
        self.assertEqual(n.drain_reason, "GPU health: GPU 1: 3 uncorrected ECC errors since the "
                         "driver loaded; reset it or leave it out (distrain-worker --gpus), and "
                         "the node takes work again")
        self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=3, devices=usage))
        [n] = self.nodes()
        self.assertEqual((n.drained, n.drain_reason), (False, ""))

        self.call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, seq=4, devices=usage[:1]))
        self.assertEqual(list(self.nodes()[0].usage), listed[:1])
        wait_until(lambda: self.nodes()[0].state == pb.NODE_DEAD, 10, "the node to be dead")
        self.assertEqual(list(self.nodes()[0].usage), [])
        r = self.ctl("nodes", *args)
        self.assertIn("2x %s, 160.0 GiB" % name, r.stdout)


# ---------------------------------------------------------------------------------------------
# 13. Chaos: seeded random failures of a 4-rank job; every run must end as the uninterrupted one
# ---------------------------------------------------------------------------------------------

class T14_Logs(ClusterTest):
    """distrainctl logs over RPC: the agents serve their trainers' logs through the
    coordinator, so logs of remote nodes work."""

    def hidden_ctl(self, *args):
        """distrainctl's command line, run in a mount namespace of its own where an empty tmpfs
        covers every agent's work directory: the logs can only come over RPC. Where no mount
        namespace can be made it runs as is (the RPC path reads no local file either)."""
        cmd = [binary("coordinator", "distrainctl"), "logs", "--coordinator", self.addr,
               "--token-file", self.token_file] + list(args)
        if not getattr(self, "_can_hide", None):
            return cmd
        mounts = " && ".join("mount -t tmpfs none %s" % w for w in self.work_dirs())
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                mounts + ' && exec "$@"', "sh"] + cmd

    def work_dirs(self):
        return [os.path.join(self.tmp, "work-" + h) for h in sorted(self.agents)]

    def logs(self, *args):
        return subprocess.run(self.hidden_ctl(*args), capture_output=True, text=True,
                              env=self.env, cwd=self.tmp, timeout=60)

    def test_old_logs_are_deleted_with_keep_logs_days(self):
        """distrain-worker --keep-logs-days 2: at start, the rank logs of each job none of whose
        logs was written for 2 days are deleted, and its directory once nothing else is in it;
        a job with a newer log keeps its old ones too, and another file in a job's directory
        and a file that is not a job's log stay. Once a job's trainer exits here, the check
        runs again (a job whose logs aged meanwhile goes)."""
        work = os.path.join(self.tmp, "work-h0")
        old = time.time() - 3 * 86400

        def put(rel, mtime=None):
            path = os.path.join(work, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("a line\n")
            if mtime:
                os.utime(path, (mtime, mtime))
            return path
        gone = [put("job-7/rank-0.log", old), put("job-7/rank-1.log", old),
                put("job-8/rank-0.log", old)]
        kept = [put("job-8/notes.txt", old), put("job-9/rank-0.log"), put("job-9/rank-1.log", old),
                put("rank-0.log", old), put("job-10/rank-0.log.1", old)]
        self.start_coordinator()
        self.start_agent("h0", args=["--keep-logs-days", "2"])
        self.wait_nodes(1)
        self.assertEqual([p for p in gone if os.path.exists(p)], [])
        self.assertEqual([p for p in kept if not os.path.exists(p)], [])
        self.assertFalse(os.path.exists(os.path.join(work, "job-7")))
        self.assertIn("deleted 3 rank logs of jobs not written for 2 days (--keep-logs-days), "
                      "and 1 job directory left empty, from %s" % work,
                      read_text(os.path.join(self.tmp, "agent-h0.log")))
        os.utime(kept[1], (old, old))  # job-9's newest log ages; a job's trainer exits here
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(
            spec=job_spec(os.path.join(self.tmp, "ckpt"), 2, every=0))).job_id
        self.wait_state(job_id, [pb.JOB_COMPLETED], 60)
        wait_until(lambda: not os.path.exists(os.path.join(work, "job-9")), 10,
                   "job-9's aged logs to be deleted after the trainer exited")
        self.assertTrue(os.path.exists(os.path.join(work, job_id, "rank-0.log")))

    def test_logs_of_remote_ranks_follow_and_errors(self):
        """A dp=2 job on two agents: `logs JOB --rank 1 --follow` started while it runs streams
        rank 1's log (its first lines come before the job ends) and exits 0 once the job has
        completed, with exactly the bytes of the file on that agent's disk; rank 0's step lines
        stream the same way. Plain `logs` (rank 0 by default, --rank 1) returns each rank's file
        while the files are hidden from distrainctl. A rank or job that does not exist, and a
        rank whose node is dead, are clear errors with exit code 1."""
        self.start_coordinator()
        self.start_agent("h0")
        self.start_agent("h1")
        self.wait_nodes(2)
        for w in self.work_dirs():
            os.makedirs(w, exist_ok=True)
        self._can_hide = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "none",
             self.work_dirs()[0]], capture_output=True).returncode == 0
        if not self._can_hide:
            sys.stderr.write("(no mount namespace here: distrainctl runs with the work "
                             "directories visible) ")
        steps = slow_steps(5.0)
        spec = job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=SLOW, dp=2)
        job_id = self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [pb.JOB_RENDEZVOUS, pb.JOB_RUNNING], 20)

        # --follow of both ranks while the job runs; every chunk read is timestamped
        got = {}

        def follow(key, rank=1):
            p = subprocess.Popen(self.hidden_ctl(job_id, "--rank", str(rank), "--follow"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                                 cwd=self.tmp)
            self.procs.append(p)
            got[key] = []

            def reader():
                for line in iter(p.stdout.readline, b""):
                    got[key].append((time.monotonic(), line))
            t = threading.Thread(target=reader, daemon=True)
            t.start()
            return p, t

        followers = {r: follow(r, r) for r in (0, 1)}

        # Held reads are bounded per node, and a reader that goes away is forgotten: ten reads
        # waiting for rank 1's log to grow (it does not until the end), at most 8 held, the
        # rest RESOURCE_EXHAUSTED; once cancelled, a new read is served at once.
        j = self.wait_state(job_id, [pb.JOB_RUNNING], 20, min_step=1)
        self.assertFalse(j.state == pb.JOB_COMPLETED, "the job ended too soon")
        # rank -> the agent it runs on (the nodes' trainer lists forget a finished job's ranks)
        host = {r.rank: r.hostname for r in j.ranks}
        h1 = host[1]
        size = os.path.getsize(os.path.join(self.tmp, "work-" + h1, job_id, "rank-1.log"))
        wait = pb.GetLogsRequest(job_id=job_id, rank=1, offset=size, wait_ms=20000)
        futs = [self._stub.GetLogs.future(wait, metadata=self.auth(), timeout=60)
                for _ in range(10)]
        def refused_all():  # every read past the bound (the replies may trail each other)
            r = [f for f in futs if f.done() and f.exception() is not None and
                 f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
            return r if len(r) >= len(futs) - 8 else None

        refused = wait_until(refused_all, 10, "reads past the per-node bound to be refused")
        self.assertIn("log reads waiting", refused[0].details())
        self.assertLessEqual(len([f for f in futs if not f.done()]), 8)
        # A follower that starts while the node's reads are at their bound waits for a free
        # one (they expire within their wait) instead of giving up.
        late, late_reader = follow("late")
        time.sleep(1.5)
        self.assertIsNone(late.poll(), "a follower gave up on a busy node: %s"
                          % late.stderr.read().decode(errors="replace"))
        for f in futs:
            f.cancel()
        t0 = time.monotonic()
        now = pb.GetLogsRequest(job_id=job_id, rank=1, offset=0, wait_ms=0)
        first = wait_until(lambda: self.call("GetLogs", now, timeout=10), 5,
                           "a read once the held ones were cancelled")
        self.assertLess(time.monotonic() - t0, 5)
        self.assertTrue(first.data.startswith(b"==== job %s generation 1 rank 1" %
                                              job_id.encode()), first.data[:200])

        done = self.wait_state(job_id, [pb.JOB_COMPLETED], 120)
        ended = time.monotonic()
        j = self.get_job(job_id)
        self.assertEqual((done.generation, done.restarts), (1, 0))
        self.assertEqual(sorted(host), [0, 1], j)
        self.assertNotEqual(host[0], host[1])
        files = {}
        for r in (0, 1):
            with open(os.path.join(self.tmp, "work-" + host[r], job_id, "rank-%d.log" % r),
                      "rb") as f:
                files[r] = f.read()
        for r, (p, t) in followers.items():
            rc = p.wait(timeout=30)
            t.join(timeout=10)
            err = p.stderr.read().decode(errors="replace")
            self.assertEqual(rc, 0, err)
            self.assertEqual(b"".join(x for _, x in got[r]), files[r], "rank %d: %s" % (r, err))
            self.assertIn("%s rank %d on node-" % (job_id, r), err)
            self.assertIn("(%s)" % host[r], err)
            early = [x for when, x in got[r] if when < ended]
            self.assertTrue(early, "rank %d: nothing streamed before the job ended" % r)
        self.assertEqual(late.wait(timeout=30), 0, late.stderr.read().decode(errors="replace"))
        late_reader.join(timeout=10)
        self.assertEqual(b"".join(x for _, x in got["late"]), files[1])
        self.assertIn(b"==== job %s generation 1 rank 1" % job_id.encode(), files[1])
        self.assertIn(b"[rank 1] plan: rank 1 of 2", files[1])
        steps_early = [x for when, x in got[0] if when < ended and b"step " in x]
        self.assertGreater(len(steps_early), 1, "rank 0's step lines were not streamed")

        # plain logs: rank 0 by default, --rank 1; the bytes of each agent's file
        r = self.logs(job_id)
        self.assertEqual((r.returncode, r.stdout.encode()), (0, files[0]), r.stderr)
        r = self.logs(job_id, "--rank", "1")
        self.assertEqual((r.returncode, r.stdout.encode()), (0, files[1]), r.stderr)
        if self._can_hide:  # the hiding works: the files are not there for distrainctl
            r = subprocess.run(self.hidden_ctl("--work-dir", self.work_dirs()[0], job_id),
                               capture_output=True, text=True, env=self.env, timeout=30)
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn("no log of %s rank 0" % job_id, r.stderr)

        # errors: a rank or a job that does not exist
        r = self.logs(job_id, "--rank", "2")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("job %s has no rank 2 (its ranks are 0 to 1)" % job_id, r.stderr)
        r = self.logs("job-999")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("unknown job 'job-999'", r.stderr)

        # the node holding rank 1 is dead: UNAVAILABLE at once, naming it
        self.agents[host[1]].send_signal(signal.SIGKILL)
        self.agents[host[1]].wait(timeout=5)
        wait_until(lambda: [n for n in self.nodes() if n.info.hostname == host[1] and
                            n.state == pb.NODE_DEAD], 10, "the node to be declared dead")
        t0 = time.monotonic()
        r = self.logs(job_id, "--rank", "1")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertRegex(r.stderr, r"rank 1 of job %s ran last on node node-\d \(%s\), which is "
                         r"dead" % (job_id, host[1]))
        self.assertLess(time.monotonic() - t0, 5)


class T13_Chaos(ClusterTest):
    FAULTS = ("trainer-kill", "trainer-stop", "agent-kill", "coordinator+trainer-kill",
              "kill-during-save", "coordinator-kill", "kill-during-recovery")

    def test_chaos(self):
        """DT_CHAOS_RUNS runs (seed DT_CHAOS_SEED) of a dp=4 job on 4 agents, each hit once at a
        random step by one of FAULTS (in turn): a trainer SIGKILLed or SIGSTOPped, an agent
        SIGKILLed (and back a second later), the coordinator SIGKILLed with a trainer, a trainer
        killed while its checkpoint is being written, the coordinator alone SIGKILLed (training
        goes on: no restart), a trainer of the recovering generation killed before it trains.
        Every run must complete with the final loss of the uninterrupted run within 1e-5
        relative, a stopped rank must be the one named, and a table of detection, recovery and
        lost work per run is printed."""
        runs = int(os.environ.get("DT_CHAOS_RUNS", "0"))
        if runs <= 0:
            self.skipTest("run by its own ctest, chaos (DT_CHAOS_RUNS=20)")
        rng = random.Random(int(os.environ.get("DT_CHAOS_SEED", "1")))
        port = free_port()
        self.start_coordinator(port=port)
        hosts = ["h%d" % i for i in range(4)]
        for h in hosts:
            self.start_agent(h, grace_ms=1000)
        self.wait_nodes(4)
        every, hang_s = 10, 3
        steps = 12 * every

        def submit(tag):
            spec = job_spec(os.path.join(self.tmp, "ckpt-" + tag), steps, shape=SLOW, every=every,
                            dp=4)
            spec.elastic.max_restarts = 10
            spec.elastic.hang_timeout_s = hang_s
            return self.call("SubmitJob", pb.SubmitJobRequest(spec=spec)).job_id

        def final_loss(job_id):
            m = self.call("GetJobMetrics", pb.GetJobMetricsRequest(job_id=job_id)).metrics
            self.assertEqual(m[-1].step, steps)
            return m[-1].loss

        ref_id = submit("ref")
        self.wait_state(ref_id, [pb.JOB_COMPLETED], 120)
        ref = final_loss(ref_id)
        rows = []
        for i in range(runs):
            fault = self.FAULTS[i % len(self.FAULTS)]
            job_id = submit("run%d" % i)
            at = rng.randrange(every + 1, steps - 3 * every)
            if fault == "kill-during-save":
                at = (at // every + 1) * every  # the step that saves
            j = self.wait_state(job_id, [pb.JOB_RUNNING], 60, min_step=at)
            gen, victim = j.generation, rng.randrange(4)

            def trainer(rank, g):
                for n in self.nodes():
                    for t in n.trainers:
                        if (t.job_id == job_id and t.rank == rank and t.pid > 0 and
                                t.generation == g):
                            return n, t
                return None

            node, tr = wait_until(lambda: trainer(victim, gen), 10, "rank %d's trainer" % victim)
            j = self.get_job(job_id)
            step_at, committed = j.step, j.committed_step
            t0 = time.monotonic()
            if fault == "coordinator-kill":
                # Nothing to detect or recover: the trainers go on through the restart.
                self.coord.send_signal(signal.SIGKILL)
                self.coord.wait(timeout=5)
                time.sleep(0.3)
                self.start_coordinator(port=port)
                wait_until(lambda: (lambda x: x if x and (x.step > step_at + 1 or x.state ==
                                                          pb.JOB_COMPLETED) else None)(
                    self.job_now(job_id)), 30, "run %d: steps after the restart" % i)
                done = self.wait_state(job_id, [pb.JOB_COMPLETED], 180)
                self.assertEqual((done.generation, done.restarts), (gen, 0), "run %d" % i)
                loss = final_loss(job_id)
                rows.append((i, fault, -1, at, 0.0, "-", time.monotonic() - t0, 0, 0, loss))
                self.assertLess(abs(loss - ref), 1e-5 * abs(ref),
                                "run %d (%s): final loss %.9g" % (i, fault, loss))
                continue
            if fault == "trainer-stop":
                os.kill(tr.pid, signal.SIGSTOP)
            elif fault == "agent-kill":
                self.agents[node.info.hostname].send_signal(signal.SIGKILL)
            else:
                os.kill(tr.pid, signal.SIGKILL)
            if fault == "coordinator+trainer-kill":
                self.coord.send_signal(signal.SIGKILL)
                self.coord.wait(timeout=5)
                time.sleep(0.3)
                self.start_coordinator(port=port)
            wait_until(lambda: (lambda x: x if x and (x.generation > gen or x.state not in (
                pb.JOB_RUNNING, pb.JOB_RENDEZVOUS)) else None)(self.job_now(job_id)),
                       hang_s + 30, "run %d (%s): the failure to be detected" % (i, fault))
            detect = time.monotonic() - t0
            if fault == "agent-kill":
                self.agents[node.info.hostname].wait(timeout=5)
                self.start_agent(node.info.hostname, grace_ms=1000)
            if fault == "kill-during-recovery":
                # The generation that replaces it loses a rank before its first step.
                gen2, victim2 = self.get_job(job_id).generation, rng.randrange(4)
                _, tr2 = wait_until(lambda: trainer(victim2, gen2), 20,
                                    "run %d: a trainer of generation %d" % (i, gen2),
                                    interval=0.01)
                os.kill(tr2.pid, signal.SIGKILL)
                gen = gen2
            # The new generation's first step (or its end: a short rest can finish, and a
            # grown job moves on to a later generation, before a poll sees it).
            wait_until(lambda: (lambda x: x if x and x.generation > gen and (
                x.state == pb.JOB_COMPLETED or x.ranks and min(r.step for r in x.ranks) >
                x.committed_step) else None)(self.job_now(job_id)), 60,
                       "run %d (%s): the new generation's first step" % (i, fault))
            recover = time.monotonic() - t0 - detect
            named = ""
            with open(os.path.join(self.tmp, "coordinator.log")) as f:
                m = re.search(r"job %s: \w+ -> RECOVERING \(generation %d\): hang: .*named: "
                              r"(rank \d+)" % (job_id, gen), f.read())
                named = m.group(1) if m else ""
            if fault == "trainer-stop":
                self.assertEqual(named, "rank %d" % victim, "run %d: the stopped rank" % i)
                try:
                    os.kill(tr.pid, signal.SIGKILL)
                except OSError:
                    pass
            done = self.wait_state(job_id, [pb.JOB_COMPLETED], 180)
            loss = final_loss(job_id)
            rows.append((i, fault, victim, at, detect, named or "-", recover,
                         max(0, step_at - committed), done.restarts, loss))
            self.assertLess(abs(loss - ref), 1e-5 * abs(ref),
                            "run %d (%s): final loss %.9g, uninterrupted %.9g" % (i, fault, loss,
                                                                                  ref))
        sys.stderr.write("\n%3s %-25s %4s %5s %9s %-8s %10s %10s %8s %12s\n" % (
            "run", "fault", "rank", "step", "detect s", "named", "recover s", "lost steps",
            "restarts", "final loss"))
        for r in rows:
            sys.stderr.write("%3d %-25s %4d %5d %9.2f %-8s %10.2f %10d %8d %12.7f\n" % r)
        sys.stderr.write("uninterrupted final loss %.7f\n" % ref)


# ---------------------------------------------------------------------------------------------

def run_tests(rest):
    """unittest over the command line's other arguments (verbose), then the shared data
    removed; returns the unittest result. For this file's main and the suites built on its
    harness."""
    try:
        return unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2).result
    finally:
        if "root" in _SHARED:
            shutil.rmtree(_SHARED["root"], ignore_errors=True)


def main():
    global BUILD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the CMake build directory")
    args, rest = ap.parse_known_args()
    BUILD = os.path.abspath(args.build)
    stub_dir = tempfile.mkdtemp(prefix="dt-cp-stubs-")
    try:
        gen_stubs(stub_dir)
        ok = run_tests(rest).wasSuccessful()
    finally:
        shutil.rmtree(stub_dir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
