"""distrain-train --profile: the per-kernel table of where a step goes (worker/trainer/profile.h).

Runs the real trainer on the tiny golden model (L2 H4 C64, vocabulary 100 padded to 128,
batch 4 x seq 32, 2 micro-batches per step) and checks:
  * the calls and FLOPs of the products against the model's own arithmetic, computed here
    from its shape: a step's linear layers do 2 N C OC per micro-batch forward and twice that
    backward over 4 per layer and the LM head, attention 4 hs per kept (query, key) pair forward,
    8 backward and 10 for the flash backward; with flash and materialized attention;
  * the memory traffic of AdamW (28 bytes a parameter) and of the GELU, the same way;
  * every kernel's time is positive and their sum is within the step's time; the table is in
    the log and, on rank 0, one {"profile": ...} line in the metrics file;
  * profiling changes nothing: the losses equal the unprofiled run's bit for bit;
  * under tensor parallelism each rank computes half of every layer (columns and rows split in
    two) and the real rows of its vocabulary slice (64 and 36 of 100), and runs the
    vocabulary-parallel cross-entropy; each pipeline stage its layer, the last the head; the
    ranks' products add up to the one process's;
  * a window running past the last step reports the steps it got; a process resumed after the
    window says that it ran none of them;
  * --profile-trace: a Chrome trace of the profiled steps (a span per step and per kernel call,
    the calls in order inside their step, as many as the table counts and as long); with pp=2
    a file per rank (%r) whose steps overlap on the host clock both share;
  * training.profile in a job spec reaches the trainer through distrainctl run --local;
  * malformed --profile and DISTRAIN_PROFILE values, and a window after the last step: a
    one-line error naming the flag or the variable, before any training.

test_gpu_trainer.py applies the same checks (check_profile and check_trace below) to the CUDA
trainer, whose times come from timed CUDA events.

    /usr/bin/python3 tests/integration/test_profile.py --build build
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher, the arguments and the metrics reader)

# The golden model and the batch of dp.base_args(4, ACCUM, ...).
L, NH, C, V, VP, B, T = 2, 4, 64, 100, 128, 4, 32
ACCUM = 2
STEPS = 4


def expected_products(attention, tp=1, tp_rank=0, layers=L, head=True, padded_head=False):
    """{kernel: (calls, GFLOP)} of a step's products, from the model's shape: a tp rank holds
    1/tp of every linear layer and its slice of the padded vocabulary, of which the LM head
    computes the real rows, or on a GPU (padded_head) the whole slice where it holds a real
    row; a pipeline stage holds its layers, and the head on the last."""
    n = B * T
    lo = tp_rank * VP // tp
    real = max(0, min(V, lo + VP // tp) - lo) if head else 0  # real vocabulary rows held
    rows = VP // tp if real and padded_head else real
    linear = 12 * C * C * layers // tp + rows * C  # qkv 3C, proj C, fc 4C, fcproj 4C; head
    calls = ACCUM * (4 * layers + (1 if rows else 0))
    pairs = T * (T + 1) / 2  # (query, key) pairs the causal mask keeps, per sequence
    attn = ACCUM * layers * C / tp * B * pairs
    if attention == "flash":
        names, bwd = ("attention_forward_flash", "attention_backward_flash"), 10
    else:
        names, bwd = ("attention_forward", "attention_backward"), 8
    out = {
        "matmul_forward": (calls, ACCUM * 2 * n * linear / 1e9),
        "matmul_backward": (calls, ACCUM * 4 * n * linear / 1e9),
    }
    if layers:
        out[names[0]] = (ACCUM * layers, 4 * attn / 1e9)
        out[names[1]] = (ACCUM * layers, bwd * attn / 1e9)
    return out


def read_profile(metrics):
    with open(metrics) as f:
        found = [json.loads(line)["profile"] for line in f if line.startswith('{"profile"')]
    return found


def log_table(err):
    """{kernel: (calls, ms, GFLOP or None)} of the profile table in a trainer's log."""
    rows = {}
    for m in re.finditer(r"^\S+(?: \[rank \d+\])?   (\w+) +(\d+) +([\d.]+) +[\d.]+% +"
                         r"(?:(\S+) (GFLOP|MB)|-) +.*$", err, re.M):
        rows[m.group(1)] = (int(m.group(2)), float(m.group(3)),
                            float(m.group(4)) if m.group(5) == "GFLOP" else None)
    return rows


def param_count(err):
    """The model's parameters from its shape (the padded vocabulary and max_seq positions as
    the trainer logs them), checked against the count it logs."""
    m = re.search(r"model: L=%d NH=%d C=%d V=%d \(Vp %d\) maxT=(\d+), (\d+) parameters"
                  % (L, NH, C, V, VP), err)
    max_t, logged = int(m.group(1)), int(m.group(2))
    count = VP * C + max_t * C + L * (12 * C * C + 13 * C) + 2 * C
    assert count == logged, (count, logged)
    return count


def check_profile(test, prof, want, steps, device):
    """A metrics file's profile record against the expected products (kernel: (calls, GFLOP));
    the names test checks to be there with their suffix (bf16 entries end in _bf16)."""
    test.assertEqual(prof["steps"], list(steps))
    test.assertEqual(prof["profiled"], steps[1] - steps[0] + 1)
    test.assertEqual(prof["device"], device)
    rows = {k["kernel"]: k for k in prof["kernels"]}
    for name, (calls, gflop) in want.items():
        test.assertIn(name, rows, "%s missing from the profile: %s" % (name, sorted(rows)))
        test.assertEqual(rows[name]["calls"], calls, name)
        test.assertAlmostEqual(rows[name]["gflop"] / gflop, 1.0, delta=1e-6,
                               msg="%s: %.9g GFLOP, the model's %.9g" % (
                                   name, rows[name]["gflop"], gflop))
    for k in prof["kernels"]:
        test.assertGreater(k["ms"], 0.0, k["kernel"])
        test.assertGreater(k["calls"], 0, k["kernel"])
    total = sum(k["ms"] for k in prof["kernels"])
    test.assertLessEqual(total, prof["step_ms"] * 1.0001,
                         "the kernels take %.3f ms of a %.3f ms step" % (total, prof["step_ms"]))


def check_trace(test, path, prof, rank=0):
    """A --profile-trace file against the profile record of the same run: a step span per
    profiled step on the steps row, every call of it on the kernels row, inside its step, one
    after another (the device runs them in order), their durations adding up to the table's."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    test.assertTrue(all(e["pid"] == rank for e in events), path)
    steps = [e for e in spans if e["cat"] == "step"]
    first, last = prof["steps"][0], prof["steps"][0] + prof["profiled"] - 1
    test.assertEqual([e["name"] for e in steps], ["step %d" % s for s in range(first, last + 1)])
    kernels = [e for e in spans if e["cat"] == "kernel"]
    test.assertTrue(all(e["tid"] == 2 for e in kernels) and all(e["tid"] == 1 for e in steps))
    calls = {k["kernel"]: k["calls"] * prof["profiled"] for k in prof["kernels"]}
    test.assertEqual({n: sum(1 for e in kernels if e["name"] == n) for n in calls}, calls)
    test.assertEqual(len(kernels), sum(calls.values()))
    total_ms = sum(k["ms"] for k in prof["kernels"]) * prof["profiled"]
    test.assertAlmostEqual(sum(e["dur"] for e in kernels) / 1e3 / total_ms, 1.0, delta=1e-4)
    eps = 1.0  # us: a GPU event's resolution, and float rounding of the offsets
    for a, b in zip(kernels, kernels[1:]):
        test.assertLessEqual(a["ts"] + a["dur"], b["ts"] + eps, (a, b))
    for st in steps:
        mine = [e for e in kernels if e["args"]["step"] == int(st["name"].split()[1])]
        test.assertTrue(mine, st)
        test.assertGreaterEqual(mine[0]["ts"], st["ts"] - eps, st)
        test.assertLessEqual(mine[-1]["ts"] + mine[-1]["dur"], st["ts"] + st["dur"] + eps, st)
    return steps


def comm_spans(events, pattern, nbytes=None):
    """The communication spans of a trace whose name matches pattern (and that moved nbytes)."""
    return [e for e in events if e.get("cat") == "comm" and re.fullmatch(pattern, e["name"])
            and (nbytes is None or abs(e["args"]["mbytes"] * 1e6 - nbytes) < 0.5)]


def check_comm(test, path, prof, rank=0):
    """A trace's communication against the table (the profile record of rank 0's run): the
    profiled thread's operations on row 3, between its kernel calls (one after another on that
    thread, on a GPU as on the host) and inside their steps; the other threads' on row 4, inside
    their steps; as many of each as the table counts; the kernels and the profiled thread's
    operations together within the step's time. Returns the trace's events."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    comm = [e for e in events if e.get("cat") == "comm"]
    rows = {("comm %s %s" % (c["group"], c["op"]), c["overlapped"]): c for c in prof["comm"]}
    eps = 1.0
    if rank == 0:
        test.assertEqual({k: c["calls"] * prof["profiled"] for k, c in rows.items()},
                         {k: sum(1 for e in comm if (e["name"], e["tid"] == 4) == k)
                          for k in rows})
        busy = sum(k["ms"] for k in prof["kernels"]) + sum(
            c["ms"] for c in prof["comm"] if not c["overlapped"])
        test.assertLessEqual(busy, prof["step_ms"] * 1.0001)
    test.assertTrue(all(e["tid"] in (3, 4) for e in comm))
    mine = sorted((e for e in events if e.get("cat") in ("kernel", "comm") and e["tid"] in (2, 3)),
                  key=lambda e: e["ts"])
    for a, b in zip(mine, mine[1:]):
        test.assertLessEqual(a["ts"] + a["dur"], b["ts"] + eps, (a, b))
    steps = {int(e["name"].split()[1]): e for e in events if e.get("cat") == "step"}
    for e in comm:
        st = steps[e["args"]["step"]]
        test.assertGreaterEqual(e["ts"], st["ts"] - eps, e)
        test.assertLessEqual(e["ts"] + e["dur"], st["ts"] + st["dur"] + eps, e)
        test.assertGreater(e["dur"], 0.0, e)
    return events


class Profile(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_profile_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_one(self, tag, extra=(), env=None, steps=STEPS, init=True):
        """One process; init=False drops the golden weights (a --resume takes its own)."""
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        argv = dp.base_args(4, ACCUM, metrics, steps)
        if not init:
            at = argv.index("--init")
            del argv[at:at + 2]
        p = subprocess.run(argv + list(extra),
                           capture_output=True, text=True, env=dict(os.environ, **(env or {})))
        return p, metrics

    def test_products_and_times(self):
        for attention in ("flash", "materialized"):
            with self.subTest(attention):
                a = ["--attention", attention]
                plain, m0 = self.run_one("plain_" + attention, a)
                self.assertEqual(plain.returncode, 0, plain.stderr[-2000:])
                prof, m1 = self.run_one("prof_" + attention, a + ["--profile", "2:2"])
                self.assertEqual(prof.returncode, 0, prof.stderr[-2000:])
                self.assertEqual([r["loss"] for r in dp.read_metrics(m0)],
                                 [r["loss"] for r in dp.read_metrics(m1)],
                                 "--profile changed the losses")
                self.assertEqual(read_profile(m0), [])
                found = read_profile(m1)
                self.assertEqual(len(found), 1)
                check_profile(self, found[0], expected_products(attention), (2, 3), "cpu")
                # the memory-bound kernels' traffic: AdamW reads parameters, gradients and
                # both moments and writes all but the gradients, 28 bytes a parameter; GELU
                # reads and writes the MLP's 4C activations of every layer and micro-batch
                mb = {k["kernel"]: k["mbytes"] for k in found[0]["kernels"]}
                self.assertAlmostEqual(mb["adamw_update"] / (28 * param_count(prof.stderr) / 1e6),
                                       1.0, delta=1e-6)
                self.assertAlmostEqual(mb["gelu_forward"] / (ACCUM * L * 8 * B * T * 4 * C / 1e6),
                                       1.0, delta=1e-6)
                self.assertIn("profile of steps 2-3 on cpu:", prof.stderr)
                self.assertIn("(the rest: copies, communication, host)", prof.stderr)
                table = log_table(prof.stderr)
                self.assertEqual({k: v[0] for k, v in table.items()},
                                 {k["kernel"]: k["calls"] for k in found[0]["kernels"]})

    def test_model_flops_and_mfu(self):
        """Every step's model TFLOP/s per device is (6 P + 12 L C T) x tokens/s / ranks, and
        its MFU that over --peak-tflops; a CPU run without the flag reports no MFU."""
        fpt = None
        for tag, world, extra in (("mfu1", 1, ["--peak-tflops", "0.002"]),
                                  ("mfu2", 2, ["--peak-tflops", "0.002"]), ("nopeak", 1, [])):
            with self.subTest(tag):
                metrics = os.path.join(self.tmp, tag + ".jsonl")
                args = [a for a in dp.base_args(4 // world, ACCUM, metrics, STEPS)
                        if a != "--quiet"]
                if world == 1:
                    p = subprocess.run(args + extra, capture_output=True, text=True)
                    self.assertEqual(p.returncode, 0, p.stderr[-2000:])
                    err = p.stderr
                else:
                    kv = tempfile.mkdtemp(dir=self.tmp)
                    outs = dp.wait_all(dp.launch(world, lambda r: args + extra, kv))
                    dp.assert_ranks_ok(outs, tag)
                    err = outs[0][2]
                if fpt is None:
                    fpt = 6 * param_count(err) + 12 * L * C * T
                self.assertIn("model FLOPs: %.4g a token (6 P + 12 L C T); " % fpt, err)
                rows = dp.read_metrics(metrics)
                self.assertEqual(len(rows), STEPS)
                for r in rows:
                    want = fpt * r["tokens_per_s"] / world / 1e12
                    self.assertAlmostEqual(r["tflops"], want, delta=2e-5 * want)
                    if extra:
                        self.assertAlmostEqual(r["mfu"], r["tflops"] / 0.002, delta=2e-5 * r["mfu"])
                    else:
                        self.assertNotIn("mfu", r)
                if extra:
                    self.assertIn("MFU against 0.002 TFLOP/s a device (--peak-tflops)", err)
                    self.assertRegex(err, r"tok/s \| MFU \d+\.\d%")
                else:
                    self.assertIn("no MFU: the peak of cpu in fp32 is not known (--peak-tflops "
                                  "gives it)", err)
                    self.assertNotIn("| MFU", err)

    def test_trace(self):
        trace = os.path.join(self.tmp, "one.trace.json")
        p, m = self.run_one("trace", ["--profile", "2:2", "--profile-trace", trace])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("profile trace: %s (chrome://tracing, ui.perfetto.dev)" % trace, p.stderr)
        check_trace(self, trace, read_profile(m)[0])

    def test_pipeline_traces_line_up(self):
        """pp=2, a file per rank (%r): each stage's steps on the host clock both share, so that
        the merged traces show the stages side by side."""
        pattern = os.path.join(self.tmp, "pp.%r.json")
        metrics = os.path.join(self.tmp, "pp_trace.jsonl")
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
        outs = dp.wait_all(dp.launch(2, lambda r: dp.base_args(4, ACCUM, metrics, STEPS)
                                     + ["--pp", "2", "--profile", "3", "--profile-trace", pattern],
                                     kv))
        dp.assert_ranks_ok(outs, "pp2 trace")
        steps = []
        for r in range(2):
            with open(os.path.join(self.tmp, "pp.%d.json" % r)) as f:
                events = json.load(f)["traceEvents"]
            self.assertTrue(all(e["pid"] == r for e in events))
            [st] = [e for e in events if e.get("cat") == "step"]
            self.assertEqual(st["name"], "step 3")
            steps.append(st)
        a, b = steps
        self.assertLess(max(a["ts"], b["ts"]), min(a["ts"] + a["dur"], b["ts"] + b["dur"]),
                        "the two stages' step 3 do not overlap in time: %s" % steps)
        check_trace(self, os.path.join(self.tmp, "pp.0.json"), read_profile(metrics)[0])

    def test_the_environment_variable(self):
        p, m = self.run_one("env", env={"DISTRAIN_PROFILE": "3"})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        check_profile(self, read_profile(m)[0], expected_products("flash"), (3, 3), "cpu")
        # the flag wins over the variable
        p, m = self.run_one("flag", ["--profile", "1:2"], env={"DISTRAIN_PROFILE": "3"})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertEqual(read_profile(m)[0]["steps"], [1, 2])

    def launch(self, tag, world, extra):
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
        outs = dp.wait_all(dp.launch(world, lambda r: dp.base_args(4, ACCUM, metrics, STEPS)
                                     + list(extra) + ["--profile", "2"], kv))
        dp.assert_ranks_ok(outs, tag)
        return [log_table(err) for _, _, err in outs]

    def check_ranks(self, tables, want, what):
        """Each rank's log table against its expected products; their sum against one
        process's (nothing computed twice or left out)."""
        one = expected_products("flash")
        for r, table in enumerate(tables):
            for name, (calls, gflop) in want(r).items():
                self.assertEqual(table[name][0], calls, "%s rank %d %s" % (what, r, name))
                self.assertAlmostEqual(table[name][2] / gflop, 1.0, delta=1e-5,
                                       msg="%s rank %d %s" % (what, r, name))
        for name in one:
            total = sum(table[name][2] for table in tables if name in table)
            self.assertAlmostEqual(total / one[name][1], 1.0, delta=1e-5,
                                   msg="%s: %s summed over the ranks" % (what, name))

    def test_split_layouts(self):
        """Each rank's products, from its log: tp=2 splits every layer in two (attention by
        heads) and the vocabulary, pp=2 gives each stage one layer and the last the head."""
        tables = self.launch("tp2", 2, ["--tp", "2"])
        self.check_ranks(tables, lambda r: expected_products("flash", tp=2, tp_rank=r), "tp2")
        for table in tables:
            self.assertIn("crossentropy_vp_finish", table)
            self.assertNotIn("crossentropy_forward_backward", table)
        tables = self.launch("pp2", 2, ["--pp", "2"])
        self.check_ranks(tables, lambda r: expected_products("flash", layers=1, head=r == 1),
                         "pp2")

    def comm_run(self, tag, world, extra, env=None):
        """world ranks profiling step 2, a trace each: (rank 0's profile record, the traces'
        events by rank), each trace checked against the table by check_comm."""
        metrics = os.path.join(self.tmp, tag + ".jsonl")
        pattern = os.path.join(self.tmp, tag + ".%r.json")
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
        outs = dp.wait_all(dp.launch(world, lambda r: dp.base_args(4, ACCUM, metrics, STEPS)
                                     + list(extra) + ["--profile", "2", "--profile-trace", pattern],
                                     kv, env))
        dp.assert_ranks_ok(outs, tag)
        prof = read_profile(metrics)[0]
        return prof, [check_comm(self, pattern.replace("%r", str(r)), prof, r)
                      for r in range(world)], outs

    def test_communication(self):
        """The communication rows, against the design of each layout, from the trace's
        operations and the bytes each moves (a micro-batch's residual stream is B T C floats):
        Megatron's tensor parallelism all-reduces it once per row-parallel layer forward (the
        attention and MLP projections, and the vocabulary-parallel embedding) and once per
        column-parallel layer backward (QKV and fc, and the LM head), 4L + 2 per micro-batch;
        with sequence parallelism each of those is a reduce-scatter, and every input of a
        column-parallel layer (LN1 and LN2 forward; backward the recomputed inputs, the
        projections' output gradients, the LM head's input and the embedding's gradient) an
        all-gather, 6L + 2. A pipeline stage of two sends its activations and receives their
        gradients: 2 m B T C floats. DDP all-reduces the P gradients once per step (no_sync
        over the accumulation), on the comm thread when it overlaps and on the step's own
        otherwise; ZeRO-1 then gathers the P updated parameters."""
        act = B * T * C * 4
        prof, traces, _ = self.comm_run("tp2_comm", 2, ["--tp", "2"])
        for ev in traces:
            self.assertEqual(len(comm_spans(ev, r"comm world all_reduce", act)),
                             ACCUM * (4 * L + 2))
            self.assertEqual(comm_spans(ev, r"comm world (all_gather|reduce_scatter)", act), [])
        prof, traces, _ = self.comm_run("sp2_comm", 2, ["--tp", "2", "--sp"])
        for ev in traces:
            self.assertEqual(comm_spans(ev, r"comm world all_reduce", act), [])
            self.assertEqual(len(comm_spans(ev, r"comm world all_gather", act)),
                             ACCUM * (6 * L + 2))
            self.assertEqual(len(comm_spans(ev, r"comm world reduce_scatter", act)),
                             ACCUM * (4 * L + 2))
        for schedule in ("gpipe", "1f1b"):
            prof, traces, _ = self.comm_run("pp2_comm_" + schedule, 2,
                                            ["--pp", "2", "--pp-schedule", schedule])
            for ev in traces:
                p2p = comm_spans(ev, r"comm world (send|recv|send/recv)")
                self.assertEqual(sum(e["args"]["mbytes"] for e in p2p) * 1e6, 2 * ACCUM * act,
                                 schedule)
        for overlap in ("1", "0"):
            prof, traces, outs = self.comm_run("dp2_comm_" + overlap, 2, ["--zero-stage", "1"],
                                               {"DISTRAIN_DP_OVERLAP": overlap})
            params = param_count(outs[0][2])
            rows = {(c["op"], c["overlapped"]): c for c in prof["comm"]}
            if overlap == "1":
                self.assertEqual(rows["all_reduce", True]["mbytes"] * 1e6, 4 * params)
                self.assertIn("overlapped with the above, on the data-parallel comm thread:",
                              outs[0][2])
            else:
                self.assertFalse(any(c["overlapped"] for c in prof["comm"]), prof["comm"])
                # the gradients and the loss's average, one float
                self.assertEqual(rows["all_reduce", False]["mbytes"] * 1e6, 4 * params + 4)
            self.assertEqual(rows["all_gather", False]["mbytes"] * 1e6, 4 * params)
            self.assertRegex(outs[0][2], r"in \d+ kernel calls, [\d.]+ ms \([\d.]+%\) in \d+ "
                             r"communication calls")

    def test_through_the_control_plane(self):
        """training.profile in a job spec reaches the trainer (distrainctl run --local): the
        golden model's shape and batch, so the same products."""
        job, run_dir = os.path.join(self.tmp, "job.yaml"), os.path.join(self.tmp, "run")
        with open(job, "w") as f:
            f.write("name: prof\n"
                    "model: {layers: %d, heads: %d, channels: %d, vocab: %d, max_seq: 64}\n"
                    "data: {train: \"%s\"}\n"
                    "training: {batch: %d, micro_batch: %d, seq: %d, steps: 3, threads: 1, "
                    "profile: \"2\"}\n"
                    "checkpoint: {dir: \"%s\", every: 0}\n"
                    % (L, NH, C, V, os.path.join(dp.GOLDEN, "tiny_train.bin"), ACCUM * B, B, T,
                       os.path.join(self.tmp, "job_ckpt")))
        p = subprocess.run([os.path.join(dp.BUILD, "coordinator", "distrainctl"), "run",
                            "--local", "--run-dir", run_dir, job], capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        with open(os.path.join(run_dir, "node-0", "job-1", "rank-0.log")) as f:
            log = f.read()
        self.assertIn("profile of step 2 on cpu:", log)
        table = log_table(log)
        for name, (calls, gflop) in expected_products("flash").items():
            self.assertEqual(table[name][0], calls, name)
            self.assertAlmostEqual(table[name][2] / gflop, 1.0, delta=1e-5, msg=name)

    def test_windows_outside_the_run(self):
        p, m = self.run_one("past", ["--profile", "3:10"])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        prof = read_profile(m)[0]
        self.assertEqual((prof["steps"], prof["profiled"]), ([3, 12], 2))
        self.assertIn("profile of steps 3-12 on cpu:", p.stderr)
        ckpt = ["--ckpt-dir", os.path.join(self.tmp, "ckpt")]
        p, _ = self.run_one("stop", ckpt + ["--stop-at", "3"])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        p, m = self.run_one("resumed", ckpt + ["--resume", "--profile", "2"], init=False)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("profile of step 2: this process ran none of those steps", p.stderr)
        self.assertEqual(read_profile(m)[0]["profiled"], 0)

    def test_bad_values(self):
        for flag in ("0", "x", "2:0", "2:", ":2", "2:1:1", "-1", "2:x"):
            with self.subTest(flag):
                p, _ = self.run_one("bad", ["--profile", flag])
                self.assertEqual(p.returncode, 2)
                self.assertIn("distrain-train: --profile: expected S or S:N", p.stderr)
                self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        p, _ = self.run_one("bad_env", env={"DISTRAIN_PROFILE": "soon"})
        self.assertEqual(p.returncode, 2)
        self.assertIn("distrain-train: DISTRAIN_PROFILE: expected S or S:N", p.stderr)
        p, _ = self.run_one("trace_alone", ["--profile-trace", "x.json"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("--profile-trace needs --profile (or DISTRAIN_PROFILE)", p.stderr)
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
        outs = dp.wait_all(dp.launch(2, lambda r: dp.base_args(4, ACCUM, os.path.join(
            self.tmp, "one_file.jsonl"), STEPS) + ["--profile", "2", "--profile-trace", "t.json"],
            kv))
        for rc, _, err in outs:
            self.assertEqual(rc, 1)
            self.assertIn("--profile-trace t.json: 2 ranks would write one file; put %r (the "
                          "rank) in its name", err)
        p, m = self.run_one("late", ["--profile", "5"])
        self.assertEqual(p.returncode, 1)
        self.assertIn("--profile (or DISTRAIN_PROFILE) from step 5: the run has 4 steps",
                      p.stderr)
        self.assertFalse(os.path.exists(m) and dp.read_metrics(m), "it trained")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    args, rest = ap.parse_known_args()
    dp.BUILD = args.build
    unittest.main(argv=[sys.argv[0]] + rest)
