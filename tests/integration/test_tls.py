#!/usr/bin/python3
"""test_tls.py — TLS and mutual TLS between the coordinator, agents, trainers and distrainctl.

    /usr/bin/python3 tests/integration/test_tls.py --build BUILD_DIR [unittest args]

Each test makes its own certificate authority with the openssl command-line tool: a CA, a
server certificate for 127.0.0.1/localhost and a client certificate signed by it, and a second,
unrelated CA with a client certificate of its own (the impostor).

- Mutual TLS (--tls-cert/--tls-key/--tls-ca on the coordinator): distrainctl without TLS, with
  TLS but no client certificate, or with the impostor's certificate is refused; with a signed
  certificate it works. Two agents given the flags register, and a 2-rank job runs to the end
  with a committed checkpoint: the trainers reach the coordinator (key-value rendezvous,
  checkpoint reports) over TLS with the flags their agent inherited. An agent with the
  impostor's certificate never registers. Neither the bearer token nor the private keys appear
  in any log or in `status --json`.
- Server-only TLS: a client that trusts the CA works without a certificate of its own; one
  that trusts another CA refuses the server; DISTRAIN_TLS_SERVER_NAME lets a client dial an
  address the certificate does not name.
- Bad flags fail at once with a message naming the problem (missing file, key without
  certificate, a file that is not PEM).
- gRPC's own listener, which TLS needs, stops for good after EMFILE: the coordinator notices
  and exits 75 for its supervisor to restart it (rather than live on, unreachable).
"""
import argparse
import glob
import os
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_control_plane as cp  # noqa: E402  (the cluster harness: processes, data, jobs)


def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=60)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", name + "-ca.key",
            "-out", name + "-ca.pem", "-days", "2", "-subj", "/CN=%s test CA" % name, cwd=d)


def make_cert(d, ca, name, san=None):
    """A key and a certificate signed by ca; san: subjectAltName (a server's names)."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", name + ".key", "-out",
            name + ".csr", "-subj", "/CN=" + name, cwd=d)
    ext = []
    if san:
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write("subjectAltName=%s\n" % san)
        ext = ["-extfile", name + ".ext"]
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + "-ca.pem", "-CAkey", ca + "-ca.key",
            "-CAcreateserial", "-out", name + ".pem", "-days", "2", *ext, cwd=d)


class TlsTest(cp.ClusterTest):
    def setUp(self):
        super().setUp()
        self.pki = os.path.join(self.tmp, "pki")
        os.mkdir(self.pki)
        make_ca(self.pki, "good")
        make_ca(self.pki, "evil")
        make_cert(self.pki, "good", "server", san="IP:127.0.0.1,DNS:localhost")
        make_cert(self.pki, "good", "client")
        make_cert(self.pki, "evil", "impostor")

    def pem(self, name):
        return os.path.join(self.pki, name)

    def flags(self, cert=None, ca="good-ca.pem"):
        """--tls-* flags: cert names a key pair ("client", "server", "impostor")."""
        f = ["--tls-ca", self.pem(ca)] if ca else []
        if cert:
            f += ["--tls-cert", self.pem(cert + ".pem"), "--tls-key", self.pem(cert + ".key")]
        return f

    def nodes_cmd(self, *tls, addr=None, env=None):
        return self.ctl("nodes", "--coordinator", addr or self.addr, "--token-file",
                        self.token_file, *tls, timeout=30,
                        env=dict(self.env, DISTRAIN_CTL_RPC_TIMEOUT_MS="3000", **(env or {})))

    def assertRefused(self, r, what):
        self.assertNotEqual(r.returncode, 0, "%s was let in:\n%s" % (what, r.stdout))
        self.assertNotIn("NODE", r.stdout, what)

    def assertNoSecrets(self, texts):
        keys = [cp.read_text(self.pem(n)).splitlines()[1] for n in
                ("server.key", "client.key", "good-ca.key")]
        for name, text in texts.items():
            self.assertNotIn(self.token, text, "the token is in " + name)
            for k in keys:
                self.assertNotIn(k, text, "a private key is in " + name)

    def test_mutual_tls(self):
        self.start_coordinator(args=self.flags("server"))
        self.assertRefused(self.nodes_cmd(), "a plaintext client")
        self.assertRefused(self.nodes_cmd(*self.flags()), "a client without a certificate")
        self.assertRefused(self.nodes_cmd(*self.flags("impostor")),
                           "a client with another CA's certificate")
        self.assertRefused(self.nodes_cmd(*self.flags("impostor", ca="evil-ca.pem")),
                           "a client that trusts another CA")
        r = self.nodes_cmd(*self.flags("client"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("NODE", r.stdout)
        log = os.path.join(self.tmp, "coordinator.log")
        self.assertIn("peer did not return a certificate", cp.read_text(log))

        # Agents and their trainers: a 2-rank job with a checkpoint, all over mutual TLS.
        self.start_agent("evil", args=self.flags("impostor"))
        for h in ("h0", "h1"):
            self.start_agent(h, args=self.flags("client"))
        ckpt = os.path.join(self.tmp, "ckpt")
        job = os.path.join(self.tmp, "job.yaml")
        with open(job, "w") as f:
            f.write(cp.job_yaml(ckpt, 30, every=30, val_every=30, min_nodes=2, max_nodes=2))
        tls = self.flags("client")
        r = self.ctl("submit", "--coordinator", self.addr, "--token-file", self.token_file, *tls,
                     "--set", "parallel.dp=2", "--set",
                     "training.micro_batch=%d" % (cp.TINY["batch"] // 2), job)
        self.assertEqual(r.returncode, 0, r.stderr)
        job_id = r.stdout.strip()

        def state():
            r = self.ctl("status", job_id, "--json", "--coordinator", self.addr, "--token-file",
                         self.token_file, *tls)
            self.assertEqual(r.returncode, 0, r.stderr)
            if '"FAILED"' in r.stdout:
                raise AssertionError("the job failed: " + r.stdout)
            return r.stdout if '"COMPLETED"' in r.stdout else None

        status = cp.wait_until(state, 90, "the job's completion over mutual TLS", interval=0.3)
        self.assertTrue(os.path.isfile(os.path.join(ckpt, "step-%08d" % 30, "MANIFEST")))
        r = self.nodes_cmd(*tls)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("h0", r.stdout)
        self.assertIn("h1", r.stdout)
        self.assertNotIn("evil", r.stdout, "the impostor's agent registered")
        self.assertIsNone(self.agents["evil"].poll(), "the impostor's agent should keep trying")
        texts = {os.path.relpath(p, self.tmp): cp.read_text(p) for p in
                 glob.glob(os.path.join(self.tmp, "**", "*.log"), recursive=True)}
        self.assertGreater(len(texts), 4, texts.keys())
        texts["status --json"] = status
        self.assertNoSecrets(texts)

    def test_server_tls_without_client_certificates(self):
        self.start_coordinator(args=self.flags("server", ca=None), host="0.0.0.0")
        port = self.port
        self.addr = "127.0.0.1:%d" % port
        r = self.nodes_cmd(*self.flags())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRefused(self.nodes_cmd(), "a plaintext client")
        self.assertRefused(self.nodes_cmd(*self.flags(ca="evil-ca.pem")),
                           "a client that trusts another CA")
        # "localhost" is a name the certificate carries; 127.0.0.2 is not, until the client is
        # told which name to check.
        r = self.nodes_cmd(*self.flags(), addr="localhost:%d" % port)
        self.assertEqual(r.returncode, 0, r.stderr)
        other = "127.0.0.2:%d" % port
        self.assertRefused(self.nodes_cmd(*self.flags(), addr=other), "a misnamed server")
        r = self.nodes_cmd(*self.flags(), addr=other, env={"DISTRAIN_TLS_SERVER_NAME": "localhost"})
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_bad_flags_fail_at_once(self):
        coord = cp.binary("coordinator", "distrain-coordinator")
        base = [coord, "--listen", "127.0.0.1:0", "--state-dir", os.path.join(self.tmp, "st"),
                "--token-file", self.token_file]
        not_pem = os.path.join(self.tmp, "not.pem")
        with open(not_pem, "w") as f:
            f.write("hello\n")
        cases = [
            (["--tls-cert", os.path.join(self.tmp, "missing.pem")], 2, "missing.pem"),
            (["--tls-cert", self.pem("server.pem")], 1, "both a certificate and its key"),
            (["--tls-cert", not_pem, "--tls-key", self.pem("server.key")], 1, "not a PEM file"),
        ]
        for extra, code, msg in cases:
            r = subprocess.run(base + extra, capture_output=True, text=True, timeout=30,
                               env=self.env)
            self.assertEqual(r.returncode, code, (extra, r.stderr))
            self.assertIn(msg, r.stderr, extra)
        r = self.ctl("nodes", "--coordinator", "127.0.0.1:1", "--token-file", self.token_file,
                     "--tls-key", self.pem("client.key"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("both a certificate and its key", r.stderr)
        agent = subprocess.run([cp.binary("worker/agent", "distrain-worker"), "--coordinator",
                                "127.0.0.1:1", "--token-file", self.token_file, "--tls-ca",
                                os.path.join(self.tmp, "missing.pem")],
                               capture_output=True, text=True, timeout=30, env=self.env)
        self.assertEqual(agent.returncode, 2, agent.stderr)
        self.assertIn("missing.pem", agent.stderr)

    def test_listener_lost_to_emfile_exits_for_a_restart(self):
        self.start_coordinator(args=self.flags("server"), max_files=128)
        r = self.nodes_cmd(*self.flags("client"))
        self.assertEqual(r.returncode, 0, r.stderr)
        flood = []
        try:
            for _ in range(300):
                flood.append(socket.create_connection(("127.0.0.1", self.port), timeout=2))
        except OSError:
            pass  # the listener is gone: connections are refused once the process exits
        try:
            self.coord.wait(timeout=20)
        finally:
            for s in flood:
                s.close()
        self.assertEqual(self.coord.returncode, 75)
        text = cp.read_text(os.path.join(self.tmp, "coordinator.log"))
        self.assertIn("Too many open files", text)
        self.assertIn("TLS listener has stopped accepting", text)
        # What the supervisor does next: the restarted coordinator serves again.
        t = time.monotonic()
        self.start_coordinator(args=self.flags("server"))
        r = self.nodes_cmd(*self.flags("client"))
        self.assertEqual(r.returncode, 0, r.stderr)
        sys.stderr.write("[served again %.2f s after the restart] " % (time.monotonic() - t))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the CMake build directory")
    args, rest = ap.parse_known_args()
    cp.BUILD = os.path.abspath(args.build)
    if not shutil.which("openssl"):
        print("SKIP: the openssl command is not installed (deploy/install-deps.sh adds it)")
        sys.exit(77)
    sys.exit(0 if cp.run_tests(rest).wasSuccessful() else 1)


if __name__ == "__main__":
    main()
