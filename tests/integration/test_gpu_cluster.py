"""The control plane on GPUs: agents offering a machine's GPUs and distrainctl run --local
handing them out.

- run --local with training.device cuda: node i's agent offers GPUs i x devices_per_node, ...
  (round robin over the machine's GPUs, shared when there are fewer than devices), each trainer
  trains on its device's GPU (its log names the GPU's PCI address), and a pp=2 x tp=2 job on
  2 nodes x 2 GPUs ends with the losses of one GPU within 1e-5, its collectives on NCCL where
  every rank has a GPU of its own (emulated: tests/emul/nccl_host.cc). A CPU job on the same machine
  keeps to CPU devices; a cuda job on a machine without a GPU is refused before anything starts.
- distrain-worker --gpus: the devices it registers (distrainctl nodes: the GPUs' names and
  memory, in the order listed, a GPU listed twice twice) and the usage its heartbeats carry
  (NVML, by each device's PCI address); a list naming a GPU that is not there is refused.

On a GPU machine it runs the build's binaries (tests/gpu/run.sh bundles it: the gpu label); in
CI, with --emulated, tests/emul's: distrainctl-emul, distrain-worker-emul and distrain-train-emul
(the CUDA trainer on the CPU) on a machine of DT_EMUL_GPUS emulated GPUs, and the fake NVML of
tests/unit (fake_nvml.c) as libnvidia-ml.so.1, which knows the emulated GPUs' usage.

    /usr/bin/python3 tests/integration/test_gpu_cluster.py --build build [--emulated]
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
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_control_plane as cp  # noqa: E402  (the cluster harness)

EMULATED = False
EMUL_NAME = "distrain emulated GPU"
GIB = 1 << 30
STEPS = 6


def gpu_count():
    """GPUs on this machine (real ones: nvidia-smi; emulated: DT_EMUL_GPUS)."""
    if EMULATED:
        return int(os.environ.get("DT_EMUL_GPUS", "1"))
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len(re.findall(r"^GPU \d+:", r.stdout, re.M)) if r.returncode == 0 else 0


class GpuCluster(cp.ClusterTest):
    def setUp(self):
        super().setUp()
        self.env.pop("CUDA_VISIBLE_DEVICES", None)
        if not EMULATED:
            self.gpus = gpu_count()
            self.bin = {"distrainctl": cp.binary("coordinator", "distrainctl"),
                        "distrain-worker": cp.binary("worker/agent", "distrain-worker"),
                        "distrain-train": cp.binary("worker/trainer", "distrain-train")}
            return
        # distrainctl runs the binaries installed beside it (found through /proc/self/exe, so
        # copies, not links): the emulated ones, under the installed names.
        bin_dir = os.path.join(self.tmp, "bin")
        os.makedirs(bin_dir)
        self.bin = {}
        emul = os.path.join(cp.BUILD, "tests", "emul")
        for src, name in ((os.path.join(emul, "distrainctl-emul"), "distrainctl"),
                          (cp.binary("coordinator", "distrain-coordinator"),
                           "distrain-coordinator"),
                          (os.path.join(emul, "distrain-worker-emul"), "distrain-worker"),
                          (os.path.join(emul, "distrain-train-emul"), "distrain-train")):
            if not os.access(src, os.X_OK):
                self.skipTest("%s is not built" % src)
            self.bin[name] = os.path.join(bin_dir, name)
            shutil.copy(src, self.bin[name])
        lib = os.path.join(self.tmp, "nvml")
        os.makedirs(lib)
        shutil.copy(os.path.join(cp.BUILD, "tests", "unit", "libfake_nvml.so"),
                    os.path.join(lib, "libnvidia-ml.so.1"))
        self.gpus = 4
        # No window of link error counts ends in a test (their rates stay unknown, -1) but where
        # the test shortens it.
        self.env.update(DT_EMUL_GPUS=str(self.gpus), LD_LIBRARY_PATH=lib,
                        DISTRAIN_GPU_ERROR_WINDOW_MS="3600000")

    def ctl(self, *args, timeout=60, env=None):
        return subprocess.run([self.bin["distrainctl"]] + list(args),
                              capture_output=True, text=True, env=env or self.env, cwd=self.tmp,
                              timeout=timeout)

    def start_agent(self, host, args=(), env=None):
        work = os.path.join(self.tmp, "work-" + host)
        p = self.spawn([self.bin["distrain-worker"], "--coordinator", self.addr,
                        "--token-file", self.token_file, "--hostname", host, "--work-dir", work,
                        "--trainer", self.bin["distrain-train"]] + list(args),
                       "agent-%s.log" % host, env=dict(self.env, **(env or {})))
        self.agents[host] = p
        return p

    def nodes_json(self):
        r = self.ctl("nodes", "--json", "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        return {n["hostname"]: n for n in json.loads(r.stdout)}

    def wait_nodes(self, n, timeout=15):
        """Through distrainctl: the GPU machines have no python3-grpcio."""
        return cp.wait_until(lambda: len([x for x in self.nodes_json().values()
                                          if x["state"] == "ALIVE"]) >= n, timeout,
                             "%d alive nodes" % n)

    def local_args(self, tag, nodes, per_node, device, sets=(), steps=STEPS, every=STEPS):
        """distrainctl run --local's arguments for the test's tiny job; and its run directory
        and metrics file."""
        run_dir = os.path.join(self.tmp, "run_" + tag)
        metrics = os.path.join(self.tmp, "metrics_%s.jsonl" % tag)
        job = os.path.join(self.tmp, "job_%s.yaml" % tag)
        with open(job, "w") as f:
            f.write(cp.job_yaml(os.path.join(self.tmp, "ckpt_" + tag), steps, every=every,
                                val_every=0, min_nodes=nodes, max_nodes=nodes))
        args = ["run", "--local", "--nodes", str(nodes), "--devices-per-node", str(per_node),
                "--run-dir", run_dir, "--metrics", metrics, "--set",
                "training.device=%s" % device] + [x for s in sets for x in ("--set", s)]
        return args + [job], run_dir, metrics

    @staticmethod
    def losses(metrics):
        """{step: loss} of a run's metrics (a step taken again after a restart: its last)."""
        if not os.path.exists(metrics):
            return {}
        with open(metrics) as f:
            return {m["step"]: m["loss"] for m in map(json.loads, f.read().splitlines())}

    def run_local(self, tag, nodes, per_node, device, sets=(), env=None):
        """run --local of the test's tiny job; returns (result, run dir, losses)."""
        args, run_dir, metrics = self.local_args(tag, nodes, per_node, device, sets)
        r = self.ctl(*args, timeout=600, env=dict(self.env, **(env or {})))
        return r, run_dir, [loss for _, loss in sorted(self.losses(metrics).items())]

    def rank_log(self, run_dir, rank):
        [path] = glob.glob(os.path.join(run_dir, "node-*", "job-1", "rank-%d.log" % rank))
        return path.split(os.sep)[-3], cp.tail(path, 200000)

    def test_local_cluster_hands_out_the_gpus(self):
        """pp=2 x tp=2 on 2 nodes x 2 GPUs against one GPU, and a CPU job on the same
        machine; emulated, on 4 GPUs (one each) and on 1 (all four share it)."""
        machines = [self.gpus] + ([1] if EMULATED else [])
        r, _, ref = self.run_local("ref", 1, 1, "cuda")
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        self.assertEqual(len(ref), STEPS)
        for gpus in machines:
            tag = "pp2tp2_%dgpu" % gpus
            with self.subTest(gpus=gpus):
                env = {"DT_EMUL_GPUS": str(gpus)} if EMULATED else {}
                r, run_dir, got = self.run_local(tag, 2, 2, "cuda", ("parallel.tp=2",
                                                 "parallel.pp=2", "training.micro_batch=2"), env)
                self.assertEqual(r.returncode, 0, "%s:\n%s" % (tag, r.stderr[-3000:]))
                banner = "2 nodes x 2 GPU devices on this machine's %d GPU%s" % (
                    gpus, "" if gpus == 1 else "s")
                self.assertIn(banner, r.stderr)
                self.assertEqual(gpus < 4, "trainers share them" in r.stderr, r.stderr)
                for rank in range(4):
                    node, text = self.rank_log(run_dir, rank)
                    # the coordinator's placement: rank r on device r % 2 of its node
                    i, device = int(node.split("-")[1]), rank % 2
                    want = (2 * i + device) % gpus
                    pci = "0000:00:%02X.0" % want if EMULATED else ""
                    m = re.search(r"GPU (\d+) of (\d+) visible \(CUDA_VISIBLE_DEVICES=([^)]*)\): "
                                  r"(.+?), [\d.]+ GiB, PCI (\S+)", text)
                    self.assertTrue(m, "rank %d names no GPU:\n%s" % (rank, text[-3000:]))
                    visible = m.group(3).split(",")
                    self.assertEqual(visible[int(m.group(1))], str(want), (rank, m.group(0)))
                    if EMULATED:
                        self.assertEqual((m.group(4), m.group(5)), (EMUL_NAME, pci))
                    self.assertIn("device cuda:%s" % m.group(1), text)
                # parallel.comm auto: NCCL with a GPU per rank, else staged through the host
                _, text = self.rank_log(run_dir, 0)
                if "cannot use NCCL" not in text:  # (a build without NCCL)
                    self.assertEqual("collectives: nccl on 4 ranks, one GPU each" in text,
                                     gpus >= 4, text[-3000:])
                self.assertEqual(len(got), STEPS, tag)
                for a, b in zip(ref, got):
                    self.assertLess(abs(a - b) / abs(a), 1e-5, (tag, ref, got))

        # A CPU job on this machine: CPU devices, and its trainers see no GPU.
        r, run_dir, cpu = self.run_local("cpu", 1, 2, "cpu", ("parallel.dp=2",
                                         "training.micro_batch=2"))
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        self.assertIn("1 node x 2 CPU devices", r.stderr)
        for rank in range(2):
            self.assertIn("device cpu", self.rank_log(run_dir, rank)[1])
        for a, b in zip(ref, cpu):
            self.assertLess(abs(a - b) / abs(a), 1e-4, (ref, cpu))

    def test_stalled_nccl_rank_is_named_and_the_job_recovers(self):
        """dp=2 on 2 nodes x 1 GPU, on NCCL; rank 1's trainer is stopped (SIGSTOP) mid-run.
        Rank 0 blocks in an NCCL collective, its GPU waiting for the peer; the coordinator
        names rank 1 within hang_timeout_s from the ranks' progress reports, restarts the job
        from its last checkpoint on new communicators, and every step's loss equals the
        uninterrupted run's."""
        if self.gpus < 2:
            self.skipTest("NCCL between trainers needs two GPUs")
        sets = ("parallel.dp=2", "training.micro_batch=2", "elastic.hang_timeout_s=4",
                "elastic.max_restarts=2")
        every = 5
        ref, run_dir, metrics, p = self.faulted_run("stall", sets, 40, every)
        victim = None
        try:
            cp.wait_until(lambda: len(self.losses(metrics)) >= 2 * every, 120,
                          "%d steps" % (2 * every))
            victim = self.trainer_pid(rank=1, generation=1)
            os.kill(victim, signal.SIGSTOP)
            out, err = p.communicate(timeout=300)
        finally:
            if victim:
                try:
                    os.kill(victim, signal.SIGCONT)
                except OSError:
                    pass
            p.kill()
        self.assertEqual(p.returncode, 0, err[-3000:])
        _, log = self.rank_log(run_dir, 0)
        self.assertIn("collectives: nccl on 2 ranks, one GPU each", log)
        with open(os.path.join(run_dir, "coordinator.log")) as f:
            coord = f.read()
        self.assertRegex(coord, r"RUNNING -> RECOVERING \(generation 1\): hang: rank 0 has "
                         r"waited [\d.]+ s in [\w/]+ \w+ #\d+; rank 1 sent no report", coord[-3000:])
        self.assert_same_losses(ref, metrics)

    def faulted_run(self, tag, sets, steps, every, slow_ms=0):
        """The test's job on 2 nodes x 1 GPU run whole, then started again for a fault to be
        injected into (its trainers slow_ms slower a step, DISTRAIN_FAULT_SLOW_MS, so that the
        fault lands mid-run): (the first run's losses, the second's run directory, its metrics
        file, its distrainctl process)."""
        args, _, metrics = self.local_args(tag + "_ref", 2, 1, "cuda", sets, steps, every)
        r = self.ctl(*args, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        ref = self.losses(metrics)
        self.assertEqual(sorted(ref), list(range(1, steps + 1)))
        args, run_dir, metrics = self.local_args(tag, 2, 1, "cuda", sets, steps, every)
        env = dict(self.env, DISTRAIN_FAULT_SLOW_MS=str(slow_ms)) if slow_ms else self.env
        p = subprocess.Popen([self.bin["distrainctl"]] + args, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=self.tmp)
        return ref, run_dir, metrics, p

    def assert_same_losses(self, ref, metrics):
        """Every step of the reference run, each loss within 1e-5 (relative)."""
        got = self.losses(metrics)
        self.assertEqual(sorted(got), sorted(ref))
        for step in ref:
            self.assertLess(abs(ref[step] - got[step]) / abs(ref[step]), 1e-5, (step, ref, got))

    def health(self, text):
        """The fake NVML's health file (FAKE_NVML_HEALTH, fake_nvml.c): "PCI key=value" lines."""
        with open(self.health_file + ".tmp", "w") as f:
            f.write(text)
        os.replace(self.health_file + ".tmp", self.health_file)

    def emulated_health(self):
        if not EMULATED:
            self.skipTest("a GPU's health is injected through the fake NVML (emulated)")
        self.health_file = os.path.join(self.tmp, "nvml-health")
        self.health("")
        self.env["FAKE_NVML_HEALTH"] = self.health_file

    def test_job_moves_off_a_gpu_with_ecc_errors(self):
        """dp=2 on 2 nodes x 1 GPU (elastic.min_nodes 1); mid-run one node's GPU reports an
        uncorrected ECC error. The coordinator drains that node from that heartbeat on, naming
        the GPU and the error; the job saves its step and goes on at dp=1 on the other, and every
        step's loss equals the uninterrupted run's (the global batch is kept)."""
        self.emulated_health()
        sets = ("parallel.dp=2", "training.micro_batch=2", "elastic.min_nodes=1")
        ref, run_dir, metrics, p = self.faulted_run("ecc", sets, 40, 5, slow_ms=50)
        try:
            cp.wait_until(lambda: len(self.losses(metrics)) >= 2, 120, "2 steps")
            self.health("0000:00:01.0 ecc=2\n")  # run --local: node-1 has GPU 1
            out, err = p.communicate(timeout=300)
        finally:
            p.kill()
        self.assertEqual(p.returncode, 0, err[-3000:])
        with open(os.path.join(run_dir, "coordinator.log")) as f:
            coord = f.read()
        problem = "GPU 0: 2 uncorrected ECC errors since the driver loaded"
        # run --local's node i is host local-i, with GPU i; node ids go by registration
        good = re.search(r"node (node-\d) registered: local-0,", coord).group(1)
        self.assertRegex(coord, r"node node-\d \(local-1\) drained: no new work goes there \(reason: "
                         r"GPU health: %s; reset it or leave it out \(distrain-worker --gpus\), "
                         r"and the node takes work again\)" % problem, coord[-3000:])
        self.assertRegex(coord, r"RECOVERING -> RENDEZVOUS \(generation 2\): world 1 \(pp 1 x dp 1 x "
                         r"cp 1 x tp 1\), grad accum 2, on %s, resuming" % good, coord[-3000:])
        self.assertNotIn("lifting its drain", coord)  # (its agent's last heartbeats: no sample)
        self.assert_same_losses(ref, metrics)

    def test_unhealthy_gpu_drains_its_node_until_it_clears(self):
        """Each problem NVML reports drains the GPU's node with it as the reason (distrainctl
        nodes, Prometheus), undrain is refused while it lasts, and the drain lifts itself once the
        GPU reports none; an operator's drain is the operator's to lift; a critical Xid is
        reported until the agent restarts, unless the restarted agent ignores it
        (--ignore-xids)."""
        self.emulated_health()
        hport_file = os.path.join(self.tmp, "http.port")
        self.start_coordinator(args=["--http", "127.0.0.1:0", "--http-port-file", hport_file])
        base = "http://127.0.0.1:%d" % int(cp.read_text(hport_file).strip())
        self.start_agent("h0", ["--gpus", "0"])
        self.start_agent("h1", ["--gpus", "1"])
        self.wait_nodes(2)
        auth = ("--coordinator", self.addr, "--token-file", self.token_file)

        def node(host, pred):
            """host's entry in distrainctl nodes --json, once pred holds of it."""
            return cp.wait_until(lambda: (lambda n: n if pred(n) else None)(
                self.nodes_json()[host]), 20, "%s's next state" % host)

        n1 = node("h1", lambda n: n["usage"] and n["state"] == "ALIVE")
        id0, id1 = self.nodes_json()["h0"]["node_id"], n1["node_id"]
        self.assertEqual(n1["usage"][0] | {"memory_used_bytes": 0}, {
            "index": 0, "memory_used_bytes": 0, "memory_total_bytes": 8 * GIB,
            "utilization_pct": 20, "lost": False, "ecc_uncorrected": 0, "reset_pending": False,
            "remap_failed": False, "xid": 0, "nvlink_down": 0, "pcie_width": 16,
            "pcie_max_width": 16, "pcie_replays_per_min": -1, "nvlink_replays_per_min": -1,
            "nvlink_crc_per_min": -1, "slowdown": ""})

        def metric(name, nid):
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                text = r.read().decode()
            m = re.search(r'^%s\{node="%s",gpu="0"\} (\S+)$' % (name, nid), text, re.M)
            return float(m.group(1)) if m else None
        self.assertEqual(metric("distrain_gpu_healthy", id1), 1)
        self.assertEqual(metric("distrain_gpu_ecc_uncorrected_errors", id1), 0)

        self.health("0000:00:01.0 ecc=2\n")
        tail = "; reset it or leave it out (distrain-worker --gpus), and the node takes work again"
        ecc = "GPU 0: 2 uncorrected ECC errors since the driver loaded"

        n1 = node("h1", lambda n: n["drained"] and n["state"] == "DRAINED")
        self.assertEqual(n1["drain_reason"], "GPU health: " + ecc + tail)
        self.assertEqual(n1["gpu_problems"], ecc)
        self.assertEqual(n1["usage"][0]["ecc_uncorrected"], 2)
        self.assertFalse(self.nodes_json()["h0"]["drained"])
        self.assertEqual(metric("distrain_gpu_healthy", id1), 0)
        self.assertEqual(metric("distrain_gpu_healthy", id0), 1)
        self.assertEqual(metric("distrain_gpu_ecc_uncorrected_errors", id1), 2)
        r = self.ctl("nodes", *auth)
        self.assertRegex(r.stdout, r"%s +h1 +DRAINED .*\[drained: GPU health: %s" % (id1, ecc))
        exe = shutil.which("chromium")  # the dashboard marks the node (test_metrics: the rest)
        if exe:
            r = subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox",
                                "--user-data-dir=" + os.path.join(self.tmp, "chromium"),
                                "--virtual-time-budget=3000", "--dump-dom", base + "/"],
                               capture_output=True, text=True, timeout=120)
            self.assertIn('<span class="badge UNHEALTHY" title="%s">GPU</span>' % ecc, r.stdout)
        r = self.ctl("undrain", id1, *auth)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("%s stays drained: %s (reset the GPU, or restart its agent with --gpus "
                      "leaving it out; the drain lifts itself once its GPUs report no problem)"
                      % (id1, ecc), r.stderr)

        # Further problems: the reason follows them.
        self.health("0000:00:01.0 ecc=2 pending=1 nvlink_down=0x4\n")
        n1 = node("h1", lambda n: "memory repairs" in n["drain_reason"])
        self.assertEqual(n1["drain_reason"], "GPU health: " + ecc + ", memory repairs wait for a "
                         "reset (row remapping or page retirement), NVLink 2 down (active when "
                         "its agent started)" + tail)
        self.assertEqual(n1["usage"][0]["nvlink_down"], 4)

        # Reset: the drain lifts itself.
        self.health("")
        node("h1", lambda n: not n["drained"] and n["state"] == "ALIVE")
        coord = cp.tail(os.path.join(self.tmp, "coordinator.log"))
        self.assertIn("its GPUs report no problem now: lifting its drain for GPU health", coord)
        self.assertIn("undrained: it takes work again", coord)

        # An operator's drain: a GPU lost meanwhile keeps its reason, and it stays after the GPU
        # is back, until the operator undrains.
        r = self.ctl("drain", id1, "--reason", "swap a DIMM", *auth)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.health("0000:00:01.0 lost=1\n")
        lost = "GPU 0: lost (it fell off the bus or needs a reset)"
        n1 = node("h1", lambda n: n["gpu_problems"] == lost)
        self.assertEqual(n1["drain_reason"], "swap a DIMM")
        self.assertEqual(n1["usage"], [{
            "index": 0, "memory_used_bytes": 0, "memory_total_bytes": 0, "utilization_pct": -1,
            "lost": True, "ecc_uncorrected": -1, "reset_pending": False, "remap_failed": False,
            "xid": 0, "nvlink_down": 0, "pcie_width": 0, "pcie_max_width": 0,
            "pcie_replays_per_min": -1, "nvlink_replays_per_min": -1, "nvlink_crc_per_min": -1,
            "slowdown": ""}])
        self.assertIsNone(metric("distrain_gpu_memory_total_bytes", id1))
        r = self.ctl("nodes", *auth)
        self.assertRegex(r.stdout, r"%s .*\[drained: swap a DIMM\]  \[unhealthy: %s\]"
                         % (id1, re.escape(lost)))
        r = self.ctl("undrain", id1, *auth)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("%s stays drained: %s" % (id1, lost), r.stderr)
        self.health("")
        node("h1", lambda n: n["usage"] and not n["usage"][0]["lost"] and not n["gpu_problems"])
        time.sleep(1)  # two heartbeats: the operator's drain stays
        self.assertEqual(self.nodes_json()["h1"]["drain_reason"], "swap a DIMM")
        r = self.ctl("undrain", id1, *auth)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(self.nodes_json()["h1"]["drained"])

        # A critical Xid event (an application's, 13, is not one): drained, and it stays
        # reported whatever NVML says next, until the agent restarts (after a reset, a reboot).
        self.health("0000:00:01.0 xid=13\n")
        time.sleep(1)
        self.assertFalse(self.nodes_json()["h1"]["drained"])
        self.health("0000:00:01.0 xid=79\n")
        xid = "GPU 0: Xid 79 (reported until its agent restarts)"
        n1 = node("h1", lambda n: n["drained"])
        self.assertEqual((n1["drain_reason"], n1["usage"][0]["xid"]),
                         ("GPU health: " + xid + tail, 79))
        self.health("")
        time.sleep(1)
        self.assertTrue(self.nodes_json()["h1"]["drained"])
        self.assertIn("GPU 0: Xid 79, a critical error of the GPU (NVML): it stays reported until "
                      "this agent restarts", cp.tail(os.path.join(self.tmp, "agent-h1.log")))
        self.agents["h1"].terminate()
        self.assertEqual(self.agents["h1"].wait(timeout=30), 0)
        self.start_agent("h1", ["--gpus", "1", "--ignore-xids", "63,79"])
        node("h1", lambda n: not n["drained"] and n["state"] == "ALIVE" and n["usage"])

        # An Xid the operator chose to ignore (--ignore-xids) is logged, and drains nothing.
        self.health("0000:00:01.0 xid=79\n")
        agent_log = os.path.join(self.tmp, "agent-h1.log")
        cp.wait_until(lambda: "GPU 0: Xid 79 (NVML), ignored (--ignore-xids)" in
                      cp.tail(agent_log), 20, "the ignored Xid logged")
        time.sleep(1)
        self.assertEqual((self.nodes_json()["h1"]["drained"],
                          self.nodes_json()["h1"]["usage"][0]["xid"]), (False, 0))
        self.health("")
        bad = self.start_agent("badxid", ["--ignore-xids", "79,x"])
        self.assertEqual(bad.wait(timeout=30), 2)
        self.assertIn("distrain-worker: --ignore-xids 79,x: expected at most 32 Xid numbers from "
                      "1 to 999 separated by commas", cp.tail(os.path.join(self.tmp,
                                                                            "agent-badxid.log")))

    def test_straggler_is_told_its_gpu_is_slowed(self):
        """dp=2 on 2 agents x 1 GPU, one agent's trainer 400 ms slower a step
        (DISTRAIN_FAULT_SLOW_MS) and its GPU reporting a hardware thermal slowdown, its PCIe
        link trained down to x8 and replaying (its counter rising 10 every 100 ms, its agent
        reading it every second): the straggler's report names them as the likely cause;
        distrainctl nodes and Prometheus show the slowdown and the replay rate; the node is not
        drained (no health problem)."""
        self.emulated_health()
        replaying = threading.Event()

        def replay():
            n = 0
            while not replaying.wait(0.1):
                n += 10
                self.health("0000:00:01.0 slow=0x40 pcie=8 pcie_replays=%d\n" % n)
        bumper = threading.Thread(target=replay)
        bumper.start()
        self.addCleanup(bumper.join)
        self.addCleanup(replaying.set)
        hport_file = os.path.join(self.tmp, "http.port")
        self.start_coordinator(args=["--http", "127.0.0.1:0", "--http-port-file", hport_file])
        base = "http://127.0.0.1:%d" % int(cp.read_text(hport_file).strip())
        self.start_agent("h0", ["--gpus", "0"])
        self.start_agent("h1", ["--gpus", "1"], env={"DISTRAIN_FAULT_SLOW_MS": "400",
                                                      "DISTRAIN_GPU_ERROR_WINDOW_MS": "1000"})
        self.wait_nodes(2)
        auth = ("--coordinator", self.addr, "--token-file", self.token_file)
        path = os.path.join(self.tmp, "dp2.yaml")
        with open(path, "w") as f:
            f.write(cp.job_yaml(os.path.join(self.tmp, "ckpt"), 100000, shape=cp.SLOW, every=0,
                                val_every=0, max_nodes=2))
        r = self.ctl("submit", *auth, path, "--set", "parallel.dp=2", "--set",
                     "training.micro_batch=4", "--set", "training.device=cuda")
        self.assertEqual(r.returncode, 0, r.stderr)
        job = r.stdout.strip()
        log = os.path.join(self.tmp, "coordinator.log")
        line = cp.wait_until(lambda: re.search(r".*is a straggler.*", cp.tail(log)), 60,
                             "a straggler").group(0)
        self.assertRegex(line, r"job %s: rank \d on node-\d \(h1\) is a straggler: [\d.]+ ms of "
                         r"compute per step, the median rank [\d.]+ ms \(reported, not "
                         r"restarted\); its GPU 0 reports itself slowed: hardware thermal "
                         r"slowdown, PCIe link x8 of x16, PCIe link replaying \(\d+ replays a "
                         r"minute\)$" % job)
        n1 = self.nodes_json()["h1"]
        self.assertEqual((n1["state"], n1["gpu_problems"]), ("ALIVE", ""))
        self.assertRegex(n1["usage"][0]["slowdown"], r"^hardware thermal slowdown, PCIe link x8 "
                         r"of x16, PCIe link replaying \(\d+ replays a minute\)$")
        self.assertGreater(n1["usage"][0]["pcie_replays_per_min"], 8)
        self.assertEqual(n1["usage"][0]["nvlink_replays_per_min"], 0)
        self.assertEqual(self.nodes_json()["h0"]["usage"][0]["slowdown"], "")
        r = self.ctl("nodes", *auth)
        self.assertRegex(r.stdout, r"h1 .*, GPU 0 slowed \(hardware thermal slowdown, PCIe link x8 "
                         r"of x16, PCIe link replaying \(\d+ replays a minute\)\)\n")
        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        self.assertRegex(text, r'\ndistrain_gpu_slowed\{node="%s",gpu="0"\} 1\n' % n1["node_id"])
        self.assertRegex(text, r'\ndistrain_gpu_pcie_replays_per_minute\{node="%s",gpu="0"\} '
                         r'[1-9]\d+\n' % n1["node_id"])
        self.assertRegex(text, r'\ndistrain_gpu_slowed\{node="%s",gpu="0"\} 0\n'
                         % self.nodes_json()["h0"]["node_id"])
        self.assertEqual(self.ctl("stop", job, "--now", *auth).returncode, 0)

    def trainer_pid(self, rank, generation):
        """The pid of this test's trainer of that rank and generation (from /proc)."""
        want = {b"RANK=%d" % rank, b"DISTRAIN_GENERATION=%d" % generation}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    argv0 = f.read().split(b"\0")[0]
                with open("/proc/%s/environ" % pid, "rb") as f:
                    env = set(f.read().split(b"\0"))
            except OSError:
                continue
            if argv0 == self.bin["distrain-train"].encode() and want <= env:
                return int(pid)
        self.fail("no trainer of rank %d, generation %d" % (rank, generation))

    def test_cuda_job_without_a_gpu_is_refused(self):
        if not EMULATED:
            self.skipTest("needs a machine without a GPU (emulated)")
        r, run_dir, _ = self.run_local("nogpu", 1, 1, "cuda", env={"DT_EMUL_GPUS": "0"})
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("training.device is cuda, but this machine has no usable GPU", r.stderr)
        self.assertFalse(os.path.exists(run_dir), "a run directory was made for a refused job")
        self.assertEqual(cp.procs_under(self.tmp), [])

    def test_agents_offer_the_gpus_listed(self):
        """--gpus: devices in the order listed (a GPU twice is two devices), their usage from
        NVML (a shared GPU's once), and each device's trainer on its GPU (device 2 of "0,L,L"
        is GPU L, which LOCAL_RANK 2 alone would not find among the 2 GPUs the trainers see);
        none: CPU devices; a GPU that is not there: refused at start."""
        self.start_coordinator()
        last = self.gpus - 1
        order = (0, last, last)
        self.start_agent("listed", ["--gpus", ",".join(map(str, order))])
        self.start_agent("cpu", ["--gpus", "none", "--cpu-devices", "2"])
        self.wait_nodes(2)
        nodes = self.nodes_json()
        self.assertEqual(nodes["cpu"]["devices"], [
            {"kind": "cpu", "index": i, "name": "cpu", "memory_bytes": 0} for i in range(2)])
        devices = nodes["listed"]["devices"]
        self.assertEqual([(d["kind"], d["index"]) for d in devices],
                         [("cuda", 0), ("cuda", 1), ("cuda", 2)])
        self.assertEqual(devices[0], devices[2] | {"index": 0})
        for d in devices:
            self.assertTrue(d["name"] and d["memory_bytes"] > 0, d)
        if EMULATED:  # fake_nvml.c's figures for emulated GPU n: n + 1 GiB used, 10 (n + 1)%
            self.assertEqual(devices[0]["name"], EMUL_NAME)

            def usage():
                n = self.nodes_json()["listed"]
                return n["usage"] if n["usage"] else None
            got = cp.wait_until(usage, 20, "the GPUs' usage in a heartbeat")
            # each GPU once, as its first device: a shared GPU is not counted twice
            self.assertEqual(got, [{"index": i, "memory_used_bytes": (g + 1) * GIB,
                                    "memory_total_bytes": 8 * GIB, "utilization_pct": 10 * (g + 1),
                                    "lost": False, "ecc_uncorrected": 0, "reset_pending": False,
                                    "remap_failed": False, "xid": 0, "nvlink_down": 0,
                                    "pcie_width": 16, "pcie_max_width": 16,
                                    "pcie_replays_per_min": -1, "nvlink_replays_per_min": -1,
                                    "nvlink_crc_per_min": -1, "slowdown": ""}
                                   for i, g in enumerate(order) if g not in order[:i]])
        r = self.ctl("nodes", "--coordinator", self.addr, "--token-file", self.token_file)
        self.assertRegex(r.stdout, r"listed .*3x ")

        # A dp=3 job on the listed node's devices: rank r on device r, so on GPU order[r].
        sets = ["parallel.dp=3", "training.batch=6", "training.micro_batch=2",
                "training.device=cuda"]
        path = os.path.join(self.tmp, "dp3.yaml")
        with open(path, "w") as f:
            f.write(cp.job_yaml(os.path.join(self.tmp, "ckpt"), 2, every=0, val_every=0))
        r = self.ctl("submit", "--coordinator", self.addr, "--token-file", self.token_file,
                     path, *[x for s in sets for x in ("--set", s)])
        self.assertEqual(r.returncode, 0, r.stderr)
        job = r.stdout.strip()

        def ended():
            r = self.ctl("status", job, "--json", "--coordinator", self.addr, "--token-file",
                         self.token_file)
            state = json.loads(r.stdout)["state"] if r.returncode == 0 else ""
            return state if state in ("COMPLETED", "FAILED") else None
        self.assertEqual(cp.wait_until(ended, 120, "the dp=3 job to end", interval=0.2),
                         "COMPLETED")
        for rank, gpu in enumerate(order):
            text = cp.tail(os.path.join(self.tmp, "work-listed", job, "rank-%d.log" % rank),
                           100000)
            m = re.search(r"GPU (\d+) of %d visible \(CUDA_VISIBLE_DEVICES=([^)]*)\)"
                          % len(set(order)), text)
            self.assertTrue(m, text[-3000:])
            self.assertEqual(m.group(2).split(",")[int(m.group(1))], str(gpu), m.group(0))

        if EMULATED:  # an agent with a CUDA_VISIBLE_DEVICES of its own: its GPU 0 is the
            # machine's GPU 3 (the first of "3,1"), and its trainers are given that name
            self.start_agent("masked", ["--gpus", "0"], env={"CUDA_VISIBLE_DEVICES": "3,1"})
            self.wait_nodes(3)
            log = cp.tail(os.path.join(self.tmp, "agent-masked.log"))
            self.assertIn("device 0: GPU 0, %s, 8.0 GiB, PCI 0000:00:03.0" % EMUL_NAME, log)
            self.assertIn("trainers see CUDA_VISIBLE_DEVICES=3\n", log)

        bad = self.start_agent("bad", ["--gpus", "0,%d" % self.gpus])
        self.assertEqual(bad.wait(timeout=30), 1)
        log = cp.tail(os.path.join(self.tmp, "agent-bad.log"))
        self.assertIn("--gpus 0,%d: expected all, none, or at most" % self.gpus, log)
        self.assertIn("shows %d GPU" % self.gpus, log)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--emulated", action="store_true",
                    help="tests/emul's binaries on emulated GPUs (CI), not the build's on this "
                    "machine's GPUs")
    args, rest = ap.parse_known_args()
    EMULATED = args.emulated
    cp.BUILD = os.path.abspath(args.build)
    if not EMULATED and gpu_count() == 0:
        print("no GPU here (nvidia-smi lists none): skipped", file=sys.stderr)
        sys.exit(77)
    sys.exit(0 if cp.run_tests(rest).wasSuccessful() else 1)
