#!/usr/bin/python3
"""test_systemd.py — the daemons under systemd's service protocol, and their units.

    /usr/bin/python3 tests/integration/test_systemd.py --build BUILD_DIR [unittest args]

- deploy/install.sh into a temporary DESTDIR: the tree it writes (binaries, units with the
  prefix substituted, example configuration kept on a second run, a 0600 token).
- `systemd-analyze verify` on both installed units, offline: --root=DESTDIR, with a copy of
  the host's /usr/lib/systemd/system there for the targets the units name, so ExecStart=
  resolves to the installed binaries. Any output (unknown keys are only warnings) fails it.
  Needs no systemd running (none is, in CI containers); systemd-analyze itself comes with the
  `systemd` package (deploy/install-deps.sh).
- The sd_notify protocol through a NOTIFY_SOCKET the test binds, as systemd would: READY=1
  once the coordinator listens / once the agent has registered (not before), STATUS= lines
  with nodes, jobs and steps, WATCHDOG=1 every half of WATCHDOG_USEC, no pings when
  WATCHDOG_PID names another process, pings that stop while the loop is blocked on purpose
  (DISTRAIN_FAULT_BLOCK_LOOP_MS) and come back after, STOPPING=1 on SIGTERM.

Processes, directories and sockets are cleaned up by the control-plane tests' base class.
"""
import argparse
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_control_plane as cp  # noqa: E402  (the cluster harness: processes, data, jobs)

SRC = cp.SRC
BUILD = None  # set by main()
HAVE_SYSTEMD = True  # set by main(): whether the daemons were built with libsystemd
WATCHDOG_USEC = 400000  # pings every 200 ms
# Sets WATCHDOG_PID to the daemon's own pid, as systemd does: sh execs setpriv, which execs the
# daemon, all in the one process Popen started.
WITH_WATCHDOG_PID = ["sh", "-c", 'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"', "sh"]


class NotifySocket:
    """A unix datagram socket standing in for systemd's notification socket; a thread
    records every message with the monotonic time it arrived."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.msgs = []  # (monotonic time, {key: value}, raw text)
        self.lock = threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            text = data.decode()
            fields = dict(line.split("=", 1) for line in text.split("\n") if "=" in line)
            with self.lock:
                self.msgs.append((time.monotonic(), fields, text))

    def close(self):
        self.stop = True
        self.thread.join(timeout=2)
        self.sock.close()

    def snapshot(self):
        with self.lock:
            return list(self.msgs)

    def times(self, key, value=None):
        return [t for t, f, _ in self.snapshot() if key in f and (value is None or f[key] == value)]

    def statuses(self):
        return [f["STATUS"] for _, f, _ in self.snapshot() if "STATUS" in f]

    def wait(self, pred, timeout, what):
        """Waits until pred(messages) is truthy; returns its value."""
        return cp.wait_until(lambda: pred(self.snapshot()), timeout, what)

    def wait_status(self, pattern, timeout, what):
        rx = re.compile(pattern)
        return self.wait(lambda m: next((f["STATUS"] for _, f, _ in m
                                         if "STATUS" in f and rx.search(f["STATUS"])), None),
                         timeout, what)


def gaps(ts):
    return [b - a for a, b in zip(ts, ts[1:])]


def install(destdir, *extra):
    return subprocess.run([os.path.join(SRC, "deploy", "install.sh"), "--build", BUILD,
                           "--destdir", destdir] + list(extra),
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# Units and install.sh
# ---------------------------------------------------------------------------------------------

class T1_Install(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dt-sd-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_install_tree(self):
        """install.sh writes binaries under the prefix (distrain-train beside distrain-worker),
        units naming the prefix, example configs it never overwrites, a 0600 token it keeps."""
        d = os.path.join(self.tmp, "root")
        r = install(d, "--prefix", "/opt/distrain")
        self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
        self.assertIn("systemctl enable --now distrain-coordinator", r.stdout)
        for b in ("distrain-coordinator", "distrain-worker", "distrain-train", "distrain-prep",
                  "distrain-convert", "distrainctl"):
            path = os.path.join(d, "opt/distrain/bin", b)
            self.assertTrue(os.access(path, os.X_OK), path)
        self.assertEqual(subprocess.run([os.path.join(d, "opt/distrain/bin/distrain-worker"),
                                         "--help"], capture_output=True).returncode, 0)
        units = os.path.join(d, "etc/systemd/system")
        for unit, binary in (("distrain-coordinator.service", "distrain-coordinator"),
                             ("distrain-worker.service", "distrain-worker")):
            with open(os.path.join(units, unit)) as f:
                text = f.read()
            self.assertRegex(text, r"(?m)^ExecStart=/opt/distrain/bin/%s " % binary)
            self.assertNotIn("ExecStart=/usr/local", text)
            for key in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "NoNewPrivileges=yes",
                        "ProtectSystem=strict", "PrivateTmp=yes", "StateDirectory=",
                        "ConfigurationDirectory=distrain", "EnvironmentFile=-/etc/distrain/"):
                self.assertIn(key, text, unit)
        with open(os.path.join(units, "distrain-worker.service")) as f:
            worker = f.read()
        self.assertIn("KillMode=mixed", worker)
        self.assertIn("DeviceAllow=char-nvidia* rw", worker)
        self.assertNotRegex(worker, r"(?m)^(PrivateDevices=yes|NoExecPaths|MemoryDenyWriteExecute)")
        conf = os.path.join(d, "etc/distrain")
        token = os.path.join(conf, "token")
        self.assertEqual(stat.S_IMODE(os.stat(token).st_mode), 0o600)
        with open(token) as f:
            tok = f.read()
        self.assertRegex(tok, r"^[0-9a-f]{48}\n$")
        for env in ("coordinator.env", "worker.env"):
            self.assertTrue(os.path.isfile(os.path.join(conf, env)), env)
        with open(os.path.join(d, "opt/distrain/share/distrain/distrain-alerts.yml")) as f:
            self.assertIn("alert: DistrainGpuUnhealthy", f.read())
        self.assertIn("/opt/distrain/share/distrain/distrain-alerts.yml to rule_files", r.stdout)
        # A second run keeps what the operator changed, and the token.
        with open(os.path.join(conf, "worker.env"), "a") as f:
            f.write("DISTRAIN_WORKER_OPTS=--coordinator mine:7470\n")
        r = install(d, "--prefix", "/opt/distrain")
        self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
        with open(os.path.join(conf, "worker.env")) as f:
            self.assertIn("mine:7470", f.read())
        with open(token) as f:
            self.assertEqual(f.read(), tok)
        # The daemons accept the token install.sh wrote (mode and format).
        probe = subprocess.run([os.path.join(d, "opt/distrain/bin/distrain-coordinator"),
                                "--listen", "127.0.0.1:0", "--token-file", token, "--state-dir",
                                os.path.join(self.tmp, "state"), "--bogus"],
                               capture_output=True, text=True)
        self.assertEqual(probe.returncode, 2)  # a bad flag: stops before serving
        bad = install(os.path.join(self.tmp, "x"), "--prefix", "relative/dir")
        self.assertEqual(bad.returncode, 2, bad.stderr)

    def test_units_verify(self):
        """systemd-analyze verify is silent on both installed units (offline, --root)."""
        analyze = shutil.which("systemd-analyze")
        self.assertIsNotNone(analyze, "systemd-analyze is missing: deploy/install-deps.sh "
                                      "installs it (package systemd)")
        d = os.path.join(self.tmp, "root")
        r = install(d)
        self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
        # The units' dependencies (network-online.target, multi-user.target, the default
        # sysinit.target, ...) are looked up under --root too: give it the host's.
        sysunits = "/usr/lib/systemd/system"
        self.assertTrue(os.path.isdir(sysunits), sysunits)
        shutil.copytree(sysunits, os.path.join(d, sysunits.lstrip("/")), symlinks=True)

        def verify(*units):
            return subprocess.run([analyze, "verify", "--man=no", "--root=" + d] + list(units),
                                  capture_output=True, text=True, timeout=60,
                                  env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"))

        v = verify("distrain-coordinator.service", "distrain-worker.service")
        self.assertEqual((v.returncode, v.stdout + v.stderr), (0, ""))
        # The check is not vacuous: a bad key and a missing binary are reported.
        unit = os.path.join(d, "etc/systemd/system/distrain-worker.service")
        with open(unit) as f:
            text = f.read()
        with open(unit, "w") as f:
            f.write(text.replace("KillMode=mixed", "KillMode=mixed\nWatchdogSecs=1"))
        v = verify("distrain-worker.service")
        self.assertIn("Unknown key 'WatchdogSecs'", v.stdout + v.stderr)
        os.unlink(os.path.join(d, "usr/local/bin/distrain-coordinator"))
        v = verify("distrain-coordinator.service")
        self.assertNotEqual(v.returncode, 0)
        self.assertIn("distrain-coordinator", v.stdout + v.stderr)


# ---------------------------------------------------------------------------------------------
# sd_notify
# ---------------------------------------------------------------------------------------------

class T2_Notify(cp.ClusterTest):
    def setUp(self):
        if not HAVE_SYSTEMD:
            raise unittest.SkipTest("built without libsystemd (DT_SYSTEMD=OFF)")
        super().setUp()
        self.sockets = []
        self.env["DISTRAIN_NOTIFY_STATUS_MS"] = "200"

    def tearDown(self):
        for s in self.sockets:
            s.close()
        super().tearDown()

    def notify_socket(self, name):
        s = NotifySocket(os.path.join(self.tmp, name))
        self.sockets.append(s)
        return s

    def notify_env(self, sock, watchdog=True, **extra):
        env = dict(self.env, NOTIFY_SOCKET=sock.path, **extra)
        if watchdog:
            env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        return env

    def coordinator(self, sock, port, wrap=WITH_WATCHDOG_PID, **extra):
        """A coordinator on a fixed port whose notifications go to sock."""
        state = os.path.join(self.tmp, "state-%d" % port)
        p = self.spawn(wrap + [cp.binary("coordinator", "distrain-coordinator"), "--listen",
                               "127.0.0.1:%d" % port, "--state-dir", state, "--token-file",
                               self.token_file, "--heartbeat-ms", str(cp.HEARTBEAT_MS)],
                       "coordinator-%d.log" % port, env=self.notify_env(sock, **extra))
        self.coord, self.port, self.addr = p, port, "127.0.0.1:%d" % port
        return p

    def agent(self, sock, host, port):
        work = os.path.join(self.tmp, "work-" + host)
        p = self.spawn(WITH_WATCHDOG_PID + [
            cp.binary("worker/agent", "distrain-worker"), "--coordinator", "127.0.0.1:%d" % port,
            "--token-file", self.token_file, "--cpu-devices", "1", "--hostname", host,
            "--work-dir", work, "--grace-ms", "2000",
            "--trainer", cp.binary("worker/trainer", "distrain-train")],
            "agent-%s.log" % host, env=self.notify_env(sock))
        self.agents[host] = p
        return p

    def assert_pings(self, ts, what):
        """WATCHDOG=1 at half of WATCHDOG_USEC (200 ms). A 2-core CI machine running builds
        beside the test may hold a process back for a while, so a single gap may exceed the
        400 ms interval here (systemd's real one is 30 s); none comes near a blocked loop's."""
        g = sorted(gaps(ts))
        self.assertGreaterEqual(len(g), 3, what)
        median = g[len(g) // 2]
        self.assertTrue(0.15 <= median <= 0.3, "%s: median gap %.3f s (%s)" % (what, median, g))
        self.assertLess(g[-1], 0.8, "%s: a gap of %.3f s (%s)" % (what, g[-1], g))

    def test_coordinator(self):
        """READY=1 only once it listens, with STATUS=; pings at half the interval; a loop
        blocked for 1.5 s stops them for that long (> WatchdogSec: systemd would restart it),
        then they resume; STOPPING=1 on SIGTERM and a clean exit."""
        sock = self.notify_socket("coord.sock")
        port = cp.free_port()
        coord = self.coordinator(sock, port, DISTRAIN_FAULT_BLOCK_LOOP_MS="1500")
        t_ready = sock.wait(lambda m: next((t for t, f, _ in m if f.get("READY") == "1"), None),
                            10, "READY=1")
        # The daemon's own pid in WATCHDOG_PID (the wrapper's doing), as systemd sets it.
        with open("/proc/%d/environ" % coord.pid, "rb") as f:
            self.assertIn(b"WATCHDOG_PID=%d" % coord.pid, f.read().split(b"\0"))
        # Listening by then: a connection succeeds at once.
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
        ready = next(f for _, f, _ in sock.snapshot() if f.get("READY") == "1")
        self.assertEqual(ready.get("STATUS"), "0 nodes, 0 jobs running")
        # The hook blocks the loop 1 s after READY=1 for 1.5 s; wait for pings after it.
        sock.wait(lambda m: len([t for t, f, _ in m if "WATCHDOG" in f and t > t_ready + 2.8]) >= 4,
                  15, "watchdog pings after the blocked loop")
        pings = sock.times("WATCHDOG", "1")
        self.assertGreater(pings[0], t_ready - 1.0)
        before = [t for t in pings if t < t_ready + 0.95]
        after = [t for t in pings if t > t_ready + 2.6]
        self.assert_pings(before, "before the block")
        self.assert_pings(after, "after the block")
        longest = max(gaps(pings))
        self.assertGreater(longest, 1.3, "no gap while the loop was blocked")
        self.assertGreater(longest, WATCHDOG_USEC / 1e6)
        self.assertLess(longest, 2.5)
        log = cp.tail(os.path.join(self.tmp, "coordinator-%d.log" % port), 40)
        self.assertIn("blocking the event loop for 1500 ms", log)
        coord.send_signal(signal.SIGTERM)
        self.assertEqual(coord.wait(timeout=10), 0)
        self.assertTrue(sock.times("STOPPING", "1"), "no STOPPING=1")

    def test_watchdog_pid(self):
        """WATCHDOG_PID naming another process (as a child of the service would see): no pings,
        and READY=1 all the same."""
        sock = self.notify_socket("coord.sock")
        self.coordinator(sock, cp.free_port(), wrap=[], WATCHDOG_PID=str(os.getpid()))
        sock.wait(lambda m: any(f.get("READY") == "1" for _, f, _ in m), 10, "READY=1")
        time.sleep(0.8)
        self.assertEqual(sock.times("WATCHDOG"), [])

    def test_agent(self):
        """The agent is READY only after it registered (started before its coordinator), its
        STATUS= names the node and then the trainer's step, the coordinator's STATUS= counts
        the node and names the running job and its step."""
        agent_sock = self.notify_socket("agent.sock")
        coord_sock = self.notify_socket("coord.sock")
        port = cp.free_port()
        agent = self.agent(agent_sock, "h0", port)
        # No coordinator yet: pings (the loop runs), no READY=1.
        agent_sock.wait(lambda m: sum("WATCHDOG" in f for _, f, _ in m) >= 5, 10, "agent pings")
        time.sleep(1.0)
        self.assertEqual(agent_sock.times("READY"), [], agent_sock.snapshot())
        self.assertIsNone(agent.poll())
        # What it waits for is in its STATUS= already (the error once a try has failed).
        agent_sock.wait_status(
            r"^registering with 127\.0\.0\.1:%d( \(last try: .+\))?, 0 trainers running$" % port,
            5, "the agent's status while registering")
        self.coordinator(coord_sock, port)
        agent_sock.wait(lambda m: any(f.get("READY") == "1" for _, f, _ in m), 15, "agent READY=1")
        ready = next(f for _, f, _ in agent_sock.snapshot() if f.get("READY") == "1")
        self.assertEqual(ready.get("STATUS"), "node-0 on 127.0.0.1:%d, 0 trainers running" % port)
        log = cp.tail(os.path.join(self.tmp, "agent-h0.log"), 40)
        self.assertIn("registered as node-0", log)
        coord_sock.wait_status(r"^1 node, 0 jobs running$", 10, "the coordinator counting the node")

        # A job: both statuses show it with its step.
        steps = cp.slow_steps(60)
        job_id = self.submit_yaml(cp.job_yaml(os.path.join(self.tmp, "ckpt"), steps,
                                              shape=cp.SLOW, every=0, val_every=0))
        agent_sock.wait_status(r"^node-0 on .*, 1 trainer running \(%s rank 0 step [1-9]\d*\)$"
                               % job_id, 30, "the agent's status with the trainer's step")
        coord_sock.wait_status(r"^1 node, 1 job running \(%s step [1-9]\d*\)$" % job_id, 30,
                               "the coordinator's status with the job's step")
        pings = agent_sock.times("WATCHDOG", "1")
        self.assert_pings(pings[-10:], "agent while training")
        agent.send_signal(signal.SIGTERM)
        self.assertEqual(agent.wait(timeout=15), 0)
        self.assertTrue(agent_sock.times("STOPPING", "1"), "no STOPPING=1 from the agent")


def main():
    global BUILD, HAVE_SYSTEMD
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the CMake build directory")
    ap.add_argument("--have-systemd", type=int, default=1,
                    help="0: the daemons were built without libsystemd (skip the sd_notify tests)")
    args, rest = ap.parse_known_args()
    BUILD = cp.BUILD = os.path.abspath(args.build)
    HAVE_SYSTEMD = bool(args.have_systemd)
    sys.exit(0 if cp.run_tests(rest).wasSuccessful() else 1)


if __name__ == "__main__":
    main()
