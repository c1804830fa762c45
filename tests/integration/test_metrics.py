#!/usr/bin/python3
"""test_metrics.py — the coordinator's /metrics endpoint, scraped by a real Prometheus server.

    /usr/bin/python3 tests/integration/test_metrics.py --build BUILD_DIR [unittest args]

- T1_Endpoint: the HTTP surface without Prometheus: the text format (HELP/TYPE before every
  family, a family's samples together, label values escaped and read back, histogram buckets
  cumulative up to le="+Inf" == _count), the content type, HEAD, 405 for every other method
  (with Allow), 404 for unknown paths, no bearer token in any answer, --http off, and an
  explicit address that is taken failing the start.
- T3_Dashboard: / (self-contained: no external URL) and /api/status (nodes and the job as
  `distrainctl nodes --json` / `status --json` print them, the mesh, the history: loss, each
  blend source's and every validation's against GetJobMetrics, the events), the page rendered
  by headless Chromium (Debian `chromium`) while a job runs, with a screenshot saved as
  BUILD/test-artifacts/dashboard.png, and its DOM once the job completed showing the job's
  final step, state and events, and its charts naming each curve with its count of points
  (their colours found in a second screenshot, dashboard-done.png).
- T2_Prometheus: a short CPU job on one agent while Prometheus (Debian `prometheus`) scrapes
  the coordinator every second from a generated configuration on loopback; its query API must
  give back the job's step, loss, validation loss, eval accuracy, state, generation,
  checkpoint, node_up and the per-rank
  series as `distrainctl status --json` and GetJobMetrics have them, a step-time histogram
  whose count grows while the job runs and ends at the job's step count with the sum of the
  steps' times, and node_up 0 once the agent is killed.

Exits 77 (skipped) when the prometheus or chromium binary is missing and everything else
passed. Processes
and directories are cleaned up by the control-plane tests' base class (test_control_plane.py).
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import unittest
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_control_plane as cp  # noqa: E402  (the cluster harness: processes, data, jobs)
import test_eval  # noqa: E402  (llm.c's eval format)

PROM_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A job name that needs escaping in a label value: a double quote and a backslash.
ODD_NAME = 'metrics "test" \\ job'

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def unescape(v):
    return re.sub(r'\\(.)', lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse_exposition(text):
    """Parses the text format strictly enough to catch a broken writer: returns
    {family: (type, [(sample name, {labels}, value)])}. Raises AssertionError on a sample
    outside its family, a family without HELP and TYPE, or a malformed line."""
    fams, current = {}, None
    lines = text.split("\n")
    assert lines[-1] == "", "the body must end with a newline"
    for ln in lines[:-1]:
        if ln.startswith("# HELP "):
            name = ln.split(" ", 3)[2]
            assert name not in fams, "family %s appears twice" % name
            current = name
            continue
        if ln.startswith("# TYPE "):
            _, _, name, typ = ln.split(" ")
            assert name == current, "TYPE %s after HELP %s" % (name, current)
            assert typ in ("gauge", "counter", "histogram"), ln
            fams[name] = (typ, [])
            continue
        m = SAMPLE.match(ln)
        assert m, "malformed sample line: %r" % ln
        name, labels_text, value = m.groups()
        labels, rest = {}, labels_text or ""
        while rest:
            lm = LABEL.match(rest)
            assert lm, "malformed labels: %r" % ln
            labels[lm.group(1)] = unescape(lm.group(2))
            rest = rest[lm.end():]
        typ = fams.get(current, (None,))[0]
        base = re.sub(r"_(bucket|sum|count)$", "", name) if typ == "histogram" else name
        assert base == current, "sample %s outside its family (current %s)" % (name, current)
        fams[current][1].append((name, labels, float(value)))
    return fams


def check_histograms(fams):
    """Buckets ascending and cumulative, +Inf last and equal to _count, per label set."""
    for fam, (typ, samples) in fams.items():
        if typ != "histogram":
            continue
        series = {}
        for name, labels, v in samples:
            key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
            series.setdefault(key, {"buckets": []})
            if name.endswith("_bucket"):
                series[key]["buckets"].append((float(labels["le"]), v))
            else:
                series[key][name.rsplit("_", 1)[1]] = v
        for key, s in series.items():
            les = [le for le, _ in s["buckets"]]
            counts = [c for _, c in s["buckets"]]
            assert les == sorted(les) and les[-1] == float("inf"), (fam, key, les)
            assert counts == sorted(counts), "%s %s: buckets not cumulative: %s" % (fam, key,
                                                                                    counts)
            assert counts[-1] == s["count"], (fam, key, counts[-1], s["count"])
            assert "sum" in s, (fam, key)


def http(url, method="GET", data=None):
    """(status, headers, body text); HTTP errors are answers too."""
    req = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def samples_of(fams, fam, **want):
    return [(n, lb, v) for n, lb, v in fams[fam][1] if all(lb.get(k) == x for k, x in
                                                            want.items())]


class MetricsTest(cp.ClusterTest):
    def start_with_http(self, *extra):
        hport_file = os.path.join(self.tmp, "http.port")
        self.start_coordinator(args=["--http", "127.0.0.1:0", "--http-port-file", hport_file]
                               + list(extra))
        self.hport = int(cp.read_text(hport_file).strip())
        self.base = "http://127.0.0.1:%d" % self.hport
        return self.hport


class T1_Endpoint(MetricsTest):
    def test_format_methods_paths_and_no_secrets(self):
        self.start_with_http()
        job_id = self.call("SubmitJob", cp.pb.SubmitJobRequest(
            spec=cp.job_spec(os.path.join(self.tmp, "ckpt"), 5, name=ODD_NAME))).job_id
        status, headers, body = http(self.base + "/metrics")
        self.assertEqual(status, 200, body)
        self.assertEqual(headers["Content-Type"], PROM_TYPE)
        fams = parse_exposition(body)
        check_histograms(fams)
        for fam, typ in (("distrain_build_info", "gauge"), ("distrain_node_up", "gauge"),
                         ("distrain_job_step", "gauge"), ("distrain_train_loss", "gauge"),
                         ("distrain_tokens_per_second", "gauge"),
                         ("distrain_heartbeat_age_seconds", "gauge"),
                         ("distrain_job_generation", "gauge"),
                         ("distrain_step_duration_seconds", "histogram"),
                         ("distrain_restarts_total", "counter"),
                         ("distrain_checkpoint_seconds", "gauge")):
            self.assertEqual(fams[fam][0], typ, fam)
        # the odd name went through escaping and reads back unchanged
        info = samples_of(fams, "distrain_job_info", job_id=job_id)
        self.assertEqual([lb["name"] for _, lb, _ in info], [ODD_NAME])
        self.assertIn('name="metrics \\"test\\" \\\\ job"', body)
        # a pending job: state PENDING, generation 0, an empty histogram, no restarts
        st = {lb["state"]: v for _, lb, v in samples_of(fams, "distrain_job_state", job_id=job_id)}
        self.assertEqual(st["PENDING"], 1)
        self.assertEqual(sum(st.values()), 1, st)
        self.assertEqual(samples_of(fams, "distrain_job_generation", job_id=job_id)[0][2], 0)
        self.assertEqual(
            [v for n, _, v in samples_of(fams, "distrain_step_duration_seconds", job_id=job_id)
             if n.endswith("_count")], [0])
        reasons = {lb["reason"] for _, lb, _ in samples_of(fams, "distrain_restarts_total")}
        self.assertEqual(reasons, {"node_dead", "trainer_failed", "nonfinite", "loss_spike",
                                   "grad_spike", "hang", "grow", "stopped", "preempted"})
        # deploy/prometheus/distrain-alerts.yml reads metrics that exist, with these reasons
        # and states (its promtool test, alerts_test.yml, checks the rules themselves)
        with open(os.path.join(cp.SRC, "deploy", "prometheus", "distrain-alerts.yml")) as f:
            rules = f.read()
        used = set(re.findall(r"\b(distrain_[a-z_]+)", rules))
        self.assertGreaterEqual(len(used), 8)
        self.assertEqual(used - set(fams), set())
        for words in re.findall(r'(?:reason|state)(?:=|=~|!~)"([^"]+)"', rules):
            self.assertLessEqual(set(words.split("|")), reasons | set(st), words)

        # HEAD: the headers of GET, no body
        status, headers, body = http(self.base + "/metrics", method="HEAD")
        self.assertEqual((status, body), (200, ""))
        self.assertEqual(headers["Content-Type"], PROM_TYPE)
        # read-only: every other method is 405 with Allow, whatever its body
        for method, data in (("POST", b"x=1"), ("PUT", b"y" * 100000), ("DELETE", None),
                             ("PATCH", b"{}")):
            status, headers, body = http(self.base + "/metrics", method=method, data=data)
            self.assertEqual(status, 405, (method, body))
            self.assertEqual(headers["Allow"], "GET, HEAD", method)
        for path in ("/nope", "/metrics/x", "/metricsx", "/api/v1/query"):
            status, _, body = http(self.base + path)
            self.assertEqual(status, 404, (path, body))
        # no secret anywhere (the token is what every RPC carries)
        for path in ("/metrics", "/nope"):
            _, _, body = http(self.base + path)
            self.assertNotIn(self.token, body, path)
        # the server still answers after all that, and so does the RPC side
        self.assertEqual(http(self.base + "/metrics")[0], 200)
        self.assertEqual(len(self.call("ListJobs", cp.pb.ListJobsRequest()).jobs), 1)

    def test_off_and_taken(self):
        # --http off: no HTTP server (the log says so by not announcing one); RPC works
        self.start_coordinator(args=["--http", "off"])
        self.assertEqual(len(self.call("ListJobs", cp.pb.ListJobsRequest()).jobs), 0)
        self.assertNotIn("serving /metrics", cp.read_text(os.path.join(self.tmp,
                                                                       "coordinator.log")))
        self.coord.kill()
        self.coord.wait()
        r = subprocess_run([cp.binary("coordinator", "distrain-coordinator"), "--http", "off",
                            "--http-port-file", os.path.join(self.tmp, "x"), "--token-file",
                            self.token_file, "--state-dir", os.path.join(self.tmp, "s2")])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--http-port-file needs --http", r.stderr)
        # an address asked for explicitly and taken: the coordinator does not start
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        try:
            r = subprocess_run([cp.binary("coordinator", "distrain-coordinator"), "--listen",
                                "127.0.0.1:0", "--http", "127.0.0.1:%d" % taken.getsockname()[1],
                                "--token-file", self.token_file, "--state-dir",
                                os.path.join(self.tmp, "s3")])
        finally:
            taken.close()
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot listen on 127.0.0.1:", r.stderr)


def subprocess_run(args):
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


class T2_Prometheus(MetricsTest):
    def setUp(self):
        super().setUp()
        self.prom_bin = shutil.which("prometheus")
        if not self.prom_bin:
            raise unittest.SkipTest("prometheus is not installed (Debian package prometheus)")

    def start_prometheus(self):
        conf = os.path.join(self.tmp, "prometheus.yml")
        with open(conf, "w") as f:
            # A plain scrape job: distrain's own label is job_id, so nothing is renamed.
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "  - job_name: distrain\n"
                    "    scrape_interval: 1s\n"
                    "    scrape_timeout: 1s\n"
                    "    static_configs: [{targets: ['127.0.0.1:%d']}]\n" % self.hport)
        self.prom_port = cp.free_port()
        self.spawn([self.prom_bin, "--config.file=" + conf,
                    "--storage.tsdb.path=" + os.path.join(self.tmp, "tsdb"),
                    "--web.listen-address=127.0.0.1:%d" % self.prom_port, "--log.level=warn"],
                   "prometheus.log")

    def query(self, q):
        """The instant vector for q as [(labels, value)], or None while Prometheus is not
        answering yet."""
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (self.prom_port,
                                                       urllib.parse.urlencode({"query": q}))
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                d = json.load(r)
        except (OSError, ValueError):
            return None
        self.assertEqual(d["status"], "success", d)
        return [(x["metric"], float(x["value"][1])) for x in d["data"]["result"]]

    def value(self, q):
        """The single value of q, or None (no answer or no series yet)."""
        r = self.query(q)
        if not r:
            return None
        self.assertEqual(len(r), 1, (q, r))
        return r[0][1]

    def wait_value(self, q, pred, timeout, what):
        def check():
            v = self.value(q)
            return (v,) if v is not None and pred(v) else None
        return cp.wait_until(check, timeout, what, interval=0.2)[0]

    def test_scraped_by_prometheus(self):
        self.start_with_http()
        self.start_prometheus()
        self.start_agent("h0")
        self.wait_nodes(1)
        # Prometheus scrapes us: the target is up and node-0 is seen alive
        self.wait_value('up{job="distrain"}', lambda v: v == 1, 30, "Prometheus scraping")
        self.wait_value('distrain_node_up{node="node-0",host="h0"}', lambda v: v == 1, 10,
                        "node_up 1")
        steps = cp.slow_steps(8)
        steps -= steps % 2
        spec = cp.job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=cp.SLOW,
                           every=steps // 2, name=ODD_NAME)
        # validation and a multiple-choice eval half way and at the end
        evalset = os.path.join(self.tmp, "eval.bin")
        test_eval.write_evalfile(evalset, test_eval.random_examples(3, 8))
        spec.data.eval = evalset
        # two named validation sets beside data.val (a label value that needs no escaping: the
        # names are [A-Za-z0-9_.-])
        spec.data.val_sets = "held.out=%s,train=%s" % (spec.data.val, spec.data.train)
        # training on a blend of two sources (the same shards), one named: a loss each
        spec.data.train = "1:web=%s,1:%s" % (spec.data.train, spec.data.train)
        spec.training.val_every = spec.training.eval_every = steps // 2
        spec.training.peak_tflops = 0.001  # a peak for the MFU on a CPU
        job_id = self.call("SubmitJob", cp.pb.SubmitJobRequest(spec=spec)).job_id
        sel = '{job_id="%s"}' % job_id

        # while it runs: a step, a histogram count that grows, one rank where it should be
        self.wait_value("distrain_job_step" + sel, lambda v: v >= 1, 30, "a step")
        self.assertEqual(self.value('distrain_job_state{job_id="%s",state="RUNNING"}' % job_id), 1)
        c1 = self.wait_value("distrain_step_duration_seconds_count" + sel, lambda v: v >= 1, 10,
                             "a counted step")
        self.assertLess(c1, steps, "Prometheus saw the job only once it had finished")
        c2 = self.wait_value("distrain_step_duration_seconds_count" + sel, lambda v: v > c1, 20,
                             "the histogram's count to grow")
        self.assertGreater(c2, c1)
        ranks = self.query("distrain_rank_info" + sel)
        self.assertEqual(len(ranks), 1, ranks)
        lb = ranks[0][0]
        self.assertEqual((lb["rank"], lb["node"], lb["host"], lb["pp"], lb["dp"], lb["tp"]),
                         ("0", "node-0", "h0", "0", "0", "0"))
        self.assertEqual([m["name"] for m, _ in self.query("distrain_job_info" + sel)],
                         [ODD_NAME])
        self.assertGreater(self.value("distrain_rank_memory_bytes" + sel), 0)

        # once it has completed, every number is final: compare with distrainctl and the RPCs
        self.wait_state(job_id, [cp.pb.JOB_COMPLETED], 120)
        self.wait_value('distrain_job_state{job_id="%s",state="COMPLETED"}' % job_id,
                        lambda v: v == 1, 10, "COMPLETED in Prometheus")
        r = self.ctl("status", job_id, "--json", "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertEqual(r.returncode, 0, r.stderr)
        st = json.loads(r.stdout)
        self.assertEqual(st["step"], steps)
        self.assertEqual(self.value("distrain_job_step" + sel), st["step"])
        prom_loss = self.value("distrain_train_loss" + sel)
        f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
        self.assertEqual(f32(prom_loss), f32(st["loss"]), (prom_loss, st["loss"]))
        self.assertAlmostEqual(self.value("distrain_tokens_per_second" + sel),
                               st["tokens_per_s"], delta=0.1)
        self.assertEqual(self.value("distrain_job_generation" + sel), st["generation"])
        self.assertEqual(self.value("distrain_checkpoint_step" + sel), st["committed_step"])
        self.assertEqual(st["committed_step"], steps)
        self.assertGreaterEqual(self.value("distrain_checkpoint_seconds" + sel), 0)
        self.assertEqual(self.value("sum(distrain_restarts_total%s)" % sel), 0)
        # the histogram: one count per step, the sum of the steps' times, +Inf == count
        ms = self.call("GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id)).metrics
        self.assertEqual(len(ms), steps)
        # before them, from after_step -1: step 0, the validation and eval before training
        # (counted nowhere above: the histogram's count is the steps')
        m0 = self.call("GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id,
                                                                   after_step=-1)).metrics[0]
        self.assertEqual((m0.step, m0.has_val, m0.has_eval, m0.loss, m0.ms, m0.tokens_per_s),
                         (0, True, True, 0, 0, 0))
        self.assertEqual([v.name for v in m0.val_sets], ["held.out", "train"])
        self.assertGreater(m0.val_loss, ms[-1].val_loss)
        # the newest validation loss and eval accuracy: those of the last step
        self.assertTrue(ms[-1].has_val and ms[-1].has_eval, ms[-1])
        self.assertEqual(f32(self.value("distrain_val_loss" + sel)), f32(ms[-1].val_loss))
        self.assertEqual(f32(self.value("distrain_eval_accuracy" + sel)),
                         f32(ms[-1].eval_acc_norm))
        # each validation set's newest loss, labelled with its name; held.out is data.val
        self.assertEqual([(v.name, v.loss) for v in ms[-1].val_sets],
                         [("held.out", ms[-1].val_loss), ("train", ms[-1].val_sets[1].loss)])
        sets = {m["set"]: v for m, v in self.query("distrain_val_set_loss" + sel)}
        self.assertEqual({k: f32(v) for k, v in sets.items()},
                         {v.name: f32(v.loss) for v in ms[-1].val_sets})
        self.assertEqual(len([m for m in ms if m.val_sets]), 2)  # half way and at the end
        # each blend source's newest training loss, labelled with its name (src2: unnamed);
        # distrainctl status JOB's, as JSON and as a line
        self.assertEqual([x.name for x in ms[-1].train_sources], ["web", "src2"])
        self.assertEqual((st["sources"]["step"], {k: f32(v) for k, v in
                                                  st["sources"]["loss"].items()}),
                         (steps, {x.name: f32(x.loss) for x in ms[-1].train_sources}))
        self.assertFalse(m0.train_sources)
        srcs = {m["source"]: v for m, v in self.query("distrain_train_source_loss" + sel)}
        self.assertEqual({k: f32(v) for k, v in srcs.items()},
                         {x.name: f32(x.loss) for x in ms[-1].train_sources})
        # distrainctl status JOB: the newest validation, as JSON and as a line
        v = st["val"]  # %.9g: a float32 read back exactly
        self.assertEqual((v["step"], f32(v["loss"]), {k: f32(x) for k, x in v["sets"].items()}),
                         (steps, f32(ms[-1].val_loss),
                          {x.name: f32(x.loss) for x in ms[-1].val_sets}))
        r = self.ctl("status", job_id, "--coordinator", self.addr, "--token-file",
                     self.token_file)
        self.assertIn("validation:  step %d | val %.4f (held.out %.4f, train %.4f)\n"
                      % (steps, ms[-1].val_loss, ms[-1].val_sets[0].loss, ms[-1].val_sets[1].loss),
                      r.stdout)
        self.assertIn("by source:   step %d (web %.4f, src2 %.4f)\n"
                      % (steps, ms[-1].train_sources[0].loss, ms[-1].train_sources[1].loss),
                      r.stdout)
        # ... and the newest evaluation's accuracies (%.6g in the JSON)
        self.assertEqual(st["eval"], {"step": steps,
                                      "acc_norm": float("%.6g" % ms[-1].eval_acc_norm),
                                      "acc": float("%.6g" % ms[-1].eval_acc)})
        self.assertIn("evaluation:  step %d: acc_norm %.4f, acc %.4f\n"
                      % (steps, ms[-1].eval_acc_norm, ms[-1].eval_acc), r.stdout)
        # the newest step's model TFLOP/s per device, and the MFU against training.peak_tflops
        self.assertGreater(ms[-1].tflops, 0)
        self.assertAlmostEqual(ms[-1].mfu, ms[-1].tflops / 0.001, delta=1e-6 * ms[-1].mfu)
        self.assertEqual(self.value("distrain_model_tflops_per_device" + sel), ms[-1].tflops)
        self.assertEqual(f32(self.value("distrain_mfu" + sel)), f32(ms[-1].mfu))
        count = self.wait_value("distrain_step_duration_seconds_count" + sel,
                                lambda v: v == steps, 10, "count == steps")
        self.assertEqual(count, steps)
        self.assertAlmostEqual(self.value("distrain_step_duration_seconds_sum" + sel),
                               sum(m.ms for m in ms) / 1000.0, delta=1e-9)
        self.assertEqual(
            self.value('distrain_step_duration_seconds_bucket{job_id="%s",le="+Inf"}' % job_id),
            steps)
        # the same with PromQL's own histogram function: a median inside the buckets' range
        med = self.value("histogram_quantile(0.5, distrain_step_duration_seconds_bucket%s)" % sel)
        self.assertTrue(0 < med <= 60, med)

        # the agent dies: its node goes down in Prometheus
        self.agents["h0"].send_signal(signal.SIGKILL)
        self.wait_value('distrain_node_up{node="node-0"}', lambda v: v == 0, 20, "node_up 0")
        self.assertGreater(self.value('distrain_heartbeat_age_seconds{node="node-0"}'), 0.3)


class T3_Dashboard(MetricsTest):
    """/ and /api/status; the page rendered by headless Chromium against a running job."""

    def chromium(self, url, *flags):
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if not exe:
            raise unittest.SkipTest("chromium is not installed (Debian package chromium)")
        profile = tempfile.mkdtemp(prefix="chromium-", dir=self.tmp)
        r = subprocess.run([exe, "--headless", "--disable-gpu", "--no-sandbox",
                            "--no-first-run", "--disable-extensions", "--hide-scrollbars",
                            "--user-data-dir=" + profile, "--virtual-time-budget=4000"]
                           + list(flags) + [url], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        return r.stdout

    def test_dashboard(self):
        self.start_with_http()
        status, headers, page = http(self.base + "/")
        self.assertEqual(status, 200)
        self.assertEqual(headers["Content-Type"], "text/html; charset=utf-8")
        self.assertIn("<title>distrain</title>", page)
        # self-contained: no script, style or font from anywhere else
        self.assertIsNone(re.search(r"(src|href)=|https?://|@import", page), "external fetch")
        self.start_agent("h0")
        self.wait_nodes(1)
        steps = cp.slow_steps(10)
        steps -= steps % 2
        spec = cp.job_spec(os.path.join(self.tmp, "ckpt"), steps, shape=cp.SLOW,
                           every=steps // 2, name=ODD_NAME)
        spec.training.peak_tflops = 1.0  # an MFU to show (a few % on a CPU)
        # validation on data.val and on a named set, from step 2 on: the newest is shown
        spec.training.val_every = 2
        spec.data.val_sets = "held.out=" + spec.data.val
        # on a blend of two sources: the newest step's loss of each is shown
        spec.data.train = "1:web=%s,1:code=%s" % (spec.data.train, spec.data.train)
        # a multiple-choice evaluation before training, half way and at the end
        evalset = os.path.join(self.tmp, "eval.bin")
        test_eval.write_evalfile(evalset, test_eval.random_examples(3, 8))
        spec.data.eval = evalset
        spec.training.eval_every = steps // 2
        job_id = self.call("SubmitJob", cp.pb.SubmitJobRequest(spec=spec)).job_id
        self.wait_state(job_id, [cp.pb.JOB_RUNNING], 30, min_step=5)

        # /api/status: the same job and nodes distrainctl prints, plus mesh, history, events
        status, headers, body = http(self.base + "/api/status")
        self.assertEqual((status, headers["Content-Type"]), (200, "application/json"))
        self.assertNotIn(self.token, body + page)
        d = json.loads(body)
        self.assertEqual([n["node_id"] for n in d["nodes"]], ["node-0"])
        ctl_nodes = json.loads(self.ctl("nodes", "--json", "--coordinator", self.addr,
                                        "--token-file", self.token_file).stdout)
        drop = ("last_heartbeat_ms", "usage")
        self.assertEqual([{k: v for k, v in n.items() if k not in drop} for n in d["nodes"]],
                         [{k: v for k, v in n.items() if k not in drop} for n in ctl_nodes])
        (x,) = d["jobs"]
        self.assertEqual(set(x), {"job", "mesh", "history"})
        self.assertEqual(list(x["job"]["sources"]["loss"]), ["web", "code"])
        self.assertEqual((x["job"]["job_id"], x["job"]["name"], x["job"]["state"]),
                         (job_id, ODD_NAME, "RUNNING"))
        self.assertEqual(x["mesh"], {"pp": 1, "dp": 1, "cp": 1, "tp": 1})
        self.assertEqual([(r["rank"], r["node_id"]) for r in x["job"]["ranks"]], [(0, "node-0")])
        h = x["history"]
        self.assertEqual(len(h["step"]), len(h["loss"]))
        self.assertEqual(len(h["step"]), len(h["mfu"]))
        self.assertTrue(all(v > 0 for v in h["mfu"]), h["mfu"])
        self.assertEqual(h["step"], sorted(h["step"]))
        self.assertGreaterEqual(h["step"][-1], 5)
        # the loss chart's other curves, each point that of the step's metrics: each blend
        # source's training loss (null where the step dealt it nothing), and every validation
        # (step 0's, before training, included), data.val's and the set's
        by_step = {m.step: m for m in self.call(
            "GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id, after_step=-1)).metrics}
        close = lambda a, b: abs(a - b) <= 1e-6 * abs(b)  # noqa: E731  (JSON's %.7g)
        self.assertEqual(list(h["sources"]), ["web", "code"])
        for name, series in h["sources"].items():
            self.assertEqual(len(series), len(h["step"]))
            for step, loss in zip(h["step"], series):
                want = [s.loss for s in by_step[step].train_sources if s.name == name]
                self.assertEqual(loss is None, not want, (name, step))
                self.assertTrue(loss is None or close(loss, want[0]), (name, step, loss, want))
        he = h["eval"]
        self.assertEqual(he["step"], [s for s in sorted(by_step) if by_step[s].has_eval])
        self.assertEqual(he["step"][0], 0)
        for i, step in enumerate(he["step"]):
            self.assertEqual((he["acc_norm"][i], he["acc"][i]),
                             (float("%.6g" % by_step[step].eval_acc_norm),
                              float("%.6g" % by_step[step].eval_acc)))
        hv = h["val"]
        self.assertEqual(hv["step"], [s for s in sorted(by_step) if by_step[s].has_val])
        self.assertEqual(hv["step"][:2], [0, 2])
        self.assertEqual(list(hv["sets"]), ["held.out"])
        for i, step in enumerate(hv["step"]):
            self.assertTrue(close(hv["loss"][i], by_step[step].val_loss), (step, hv))
            self.assertTrue(close(hv["sets"]["held.out"][i], by_step[step].val_sets[0].loss))
        # the newest validation: data.val's loss and the set's, the same data
        v = x["job"]["val"]
        self.assertEqual(v["step"] % 2, 0, v)
        self.assertGreaterEqual(v["step"], 4, v)
        self.assertEqual(v["sets"], {"held.out": v["loss"]}, v)
        texts = [e["text"] for e in d["events"]]
        self.assertTrue(any("PENDING -> RENDEZVOUS" in t for t in texts), texts)
        self.assertTrue(any("node node-0 registered" in t for t in texts), texts)

        # the page in a real browser while the job runs: a screenshot for people to look at
        shot = os.path.join(cp.BUILD, "test-artifacts", "dashboard.png")
        os.makedirs(os.path.dirname(shot), exist_ok=True)
        if os.path.exists(shot):
            os.unlink(shot)
        self.chromium(self.base + "/", "--screenshot=" + shot, "--window-size=1280,1100")
        self.assertGreater(os.path.getsize(shot), 10000)
        sys.stderr.write("\n[dashboard screenshot: %s] " % shot)

        # ... and once it completed: the DOM shows the final step the coordinator has
        done = self.wait_state(job_id, [cp.pb.JOB_COMPLETED], 120)
        dom = self.chromium(self.base + "/", "--dump-dom")
        m = re.search(r'id="step-%s">(\d+)<' % job_id, dom)
        self.assertIsNotNone(m, dom[-3000:])
        self.assertEqual(int(m.group(1)), done.step)
        self.assertEqual(done.step, steps)
        self.assertIn('class="badge COMPLETED"', dom)
        self.assertRegex(dom, r">MFU <b>\d+(\.\d)?%</b>")
        last = self.call("GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id)).metrics[-1]
        self.assertTrue(last.has_val, last)  # the last step validates: its values are shown
        shown = lambda x: "%.4f" % float("%.9g" % x)  # noqa: E731  (JSON's %.9g, then toFixed)
        self.assertIn('title="validation at step %d">val <b>%s</b>' % (steps, shown(last.val_loss)),
                      dom)
        self.assertIn('title="validation at step %d, set held.out">held.out <b>%s</b>'
                      % (steps, shown(last.val_sets[0].loss)), dom)
        for src in last.train_sources:  # the final step's loss of each blend source
            self.assertIn('title="training loss over the tokens of source %s in step %d">%s '
                          '<b>%s</b>' % (src.name, steps, src.name, shown(src.loss)), dom)
        self.assertEqual([x.name for x in last.train_sources], ["web", "code"])
        self.assertIn("node-0", dom)
        self.assertIn("RUNNING -&gt; COMPLETED", dom)  # the events list
        # the charts say what they drew: every curve with all its points (step 0's validation
        # too), and in the screenshot each curve's colour (dashboard.html's: the training loss,
        # the two sources', the validation's and the set's, its line or at least its key)
        # (at most 400 a curve: every k-th of n, k = ceil(n / 400), and the newest)
        nval = sum(m.has_val for m in self.call(
            "GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id, after_step=-1)).metrics)
        self.assertEqual(nval, len(range(0, steps, 2)) + 1)  # 0, 2, ... and the last step
        points = lambda n: len(set(range(0, n, -(-n // 400))) | {n - 1})  # noqa: E731
        ns, nv = points(steps), points(nval)
        self.assertLessEqual(max(ns, nv), 401)
        self.assertIn('role="img" aria-label="loss: train (%d points), train: web (%d points), '
                      'train: code (%d points), validation (%d points), validation: held.out '
                      '(%d points)"' % (ns, ns, ns, nv, nv), dom)
        self.assertIn('aria-label="tokens / s: tokens / s (%d points)"' % ns, dom)
        ms = self.call("GetJobMetrics", cp.pb.GetJobMetricsRequest(job_id=job_id,
                                                                   after_step=-1)).metrics
        evals = [m for m in ms if m.has_eval]
        acc = lambda x: "%.4f" % float("%.6g" % x)  # noqa: E731  (JSON's %.6g, then toFixed)
        self.assertEqual([m.step for m in evals], [0, steps // 2, steps])
        self.assertIn('aria-label="evaluation accuracy: acc_norm (3 points), acc (3 points)"', dom)
        self.assertIn('title="multiple-choice evaluation at step %d: acc_norm (by the mean loss of '
                      "a completion's tokens), acc %s (by their sum)\">eval acc_norm <b>%s</b>"
                      % (steps, acc(evals[-1].eval_acc), acc(evals[-1].eval_acc_norm)), dom)
        shot = os.path.join(cp.BUILD, "test-artifacts", "dashboard-done.png")
        self.chromium(self.base + "/", "--screenshot=" + shot, "--window-size=1280,1100")
        _, _, rows = cp.png_pixels(shot)
        colours = {"train": "2f6fde", "web": "7c3aed", "code": "0d9488", "validation": "e11d48",
                   "held.out": "a16207", "evaluation": "b45309"}
        for what, hexa in colours.items():
            want = bytes.fromhex(hexa)
            n = sum(1 for row in rows for p in row if all(abs(p[c] - want[c]) <= 12 for c in range(3)))
            self.assertGreaterEqual(n, 20, "%s's colour #%s is not drawn" % (what, hexa))

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the CMake build directory")
    args, rest = ap.parse_known_args()
    cp.BUILD = os.path.abspath(args.build)
    stub_dir = tempfile.mkdtemp(prefix="dt-metrics-stubs-")
    try:
        cp.gen_stubs(stub_dir)
        result = cp.run_tests(rest)
        ok, skipped = result.wasSuccessful(), result.skipped
    finally:
        shutil.rmtree(stub_dir, ignore_errors=True)
    if ok and skipped:
        print("skipped: %s" % "; ".join(sorted({why for _, why in skipped})))
        sys.exit(77)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
