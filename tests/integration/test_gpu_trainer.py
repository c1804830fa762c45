"""The trainer on a CUDA GPU (ctest label gpu; exits 77, a skip, where there is none): fp32
against the CPU, and parallel layouts of several trainers sharing the GPU (LOCAL_RANK modulo
the GPUs; the host-staged communicator) against one GPU process.

  * one process: the 8-step loss trajectory (5 steps on the emulated GPU) within 1e-4 relative
    of the CPU's (the kernels differ: cuBLAS against OpenBLAS, other reduction orders), in fp32
    and under --precision bf16 (both round the GEMM operands alike, and the flash attention's
    operands, probabilities and score gradients at the same points; tensor cores against
    OpenBLAS on the rounded values);
  * one process, in fp32 and bf16: --recompute, --profile (every kernel between timed events)
    and a checkpoint resumed half way bit for bit the plain run's losses, --attention
    materialized and DISTRAIN_CUDA_GEMM_TUNE=1 within 1e-4 of them (the tuning bit for bit on
    the emulated GPU, whose cuBLASLt candidates compute alike); the profile's products those of
    test_profile.py; in bf16 at head size 64, DISTRAIN_CUDA_WGMMA=1 (the flash kernels on
    Hopper's wgmma) within 1e-4 of the plain run (bit for bit on the emulated GPU);
  * dp=2 under ZeRO-3 and ZeRO-2, tp=2 with and without sequence parallelism, pp=2 (1F1B) and
    cp=2 x dp=2 under ZeRO-1: within 1e-5 of the one GPU process on the same global batch (the
    issue's multi-rank GPU check; cp also runs the CUDA context-parallel attention kernels),
    the data-parallel collectives on the comm thread by default under every ZeRO stage.
    --comm auto sees the ranks share a GPU and stages through the host; --comm nccl is refused
    there, naming the two ranks;
  * under --precision bf16, dp=2 under ZeRO-1 and ZeRO-3 and tp=2 within 1e-4 of the one GPU
    bf16 process (the bf16 weight copy as each ZeRO stage keeps it; the GELU's backward in the
    MLP projection's GEMM epilogue, split over tp). 1e-4, not 1e-5: cuBLASLt may sum a product
    of another batch shape in another order, and the bf16 activations rounded from those sums
    can then land one bf16 step apart;
  * a blend's losses by source: one GPU within 1e-4 of the CPU, pp=2 within 1e-5 of one GPU;
  * a multiple-choice evaluation (--eval): every completion's summed loss within 1e-4 of the
    CPU's in fp32, 1e-3 in bf16, and under tp=2 within 1e-5 of one GPU process;
  * with two GPUs or more, one per rank (LOCAL_RANK): dp=2 under ZeRO-3, tp=2 and pp=2 on NCCL
    (--comm nccl), within 1e-5 of the one GPU process; with four, tp=2 x dp=2 under ZeRO-3
    and pp=2 x dp=2 under ZeRO-2 too; and a peer stopped mid-training (SIGSTOP) under ZeRO-0
    and ZeRO-3: the other trainer's NCCL operation times out and it exits with the error.

Run by tests/gpu/run.sh on the GPU machine, or by hand:

    /usr/bin/python3 tests/integration/test_gpu_trainer.py --build build

CTest also runs it without a GPU (gpu_trainer_emul, label integration) on tests/emul's
distrain-train-emul: the same CUDA trainer, its kernels run on the CPU under the emulation
(--trainer build/tests/emul/distrain-train-emul). Its machine has one emulated GPU, or one per
rank for the NCCL test between GPUs, whose NCCL is tests/emul/nccl_host.cc (NCCL's calls on
the host, over distrain's own CPU communicator).
"""

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_dp as dp  # noqa: E402  (the launcher, the arguments and the metrics reader)
import test_profile  # noqa: E402  (the products a step of the golden model computes)

STEPS = 8  # per run; 5 on the emulated GPU (main), whose steps take about 0.4 s each
ACCUM = 2  # micro-batches per step (a pipeline needs at least pp)


EMULATED = False  # the trainer is tests/emul's: its machine has DT_EMUL_GPUS GPUs (default 1)


def gpu_count():
    """GPUs nvidia-smi lists (1 when it cannot tell: the tests then assume one); on the
    emulated machine as many as a test asks for (launch sets DT_EMUL_GPUS for own_gpus)."""
    if EMULATED:
        return 4
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 1
    return p.stdout.count("GPU ") if p.returncode == 0 else 1


def has_gpu():
    """Whether the trainer finds a usable CUDA GPU (one step of the tiny model on it)."""
    probe = tempfile.mkdtemp(prefix="dt_gpu_probe_")
    try:
        p = subprocess.run(dp.base_args(4, 1, os.path.join(probe, "m.jsonl"), steps=1)
                           + ["--device", "cuda"], capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return p.returncode == 0


class GpuTrainer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_gpu_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def launch(self, world, batch, device, extra, tag, own_gpus=False, env=None):
        """Runs world ranks; own_gpus gives rank r LOCAL_RANK r (GPU r), else all share GPU 0;
        env: more variables for each; the weights are the golden model's, unless extra has
        --resume (the checkpoint's) or an --init of its own. Returns the metrics path and
        (returncode, stdout, stderr) per rank."""
        metrics = os.path.join(self.tmp, "%s_%s_w%d.jsonl" % (tag, device, world))
        kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
        argv = dp.base_args(batch, ACCUM, metrics, STEPS) + ["--device", device] + list(extra)
        if "--resume" in extra or "--init" in extra:
            at = argv.index("--init")
            del argv[at:at + 2]
        env = dict(env or {})
        if own_gpus and EMULATED:
            env["DT_EMUL_GPUS"] = str(world)
        procs = dp.launch(world, lambda r: argv, kv,
                          lambda r: dict(env, LOCAL_RANK=str(r if own_gpus else 0)))
        return metrics, dp.wait_all(procs, timeout=300)

    def train(self, world, batch, device, extra=(), tag="", own_gpus=False, env=None):
        metrics, outs = self.launch(world, batch, device, extra, tag, own_gpus, env)
        dp.assert_ranks_ok(outs, tag)
        self.logs = [err for _, _, err in outs]
        return [m["loss"] for m in dp.read_metrics(metrics)]

    def assert_close(self, ref, got, tol, what):
        self.assertEqual(len(ref), len(got), what)
        for i, (a, b) in enumerate(zip(ref, got)):
            self.assertLess(abs(a - b) / abs(a), tol, "%s step %d: %.9g vs %.9g" % (what, i + 1,
                                                                                    b, a))

    def test_one_gpu_against_the_cpu(self):
        self.assert_close(self.train(1, 4, "cpu", tag="one"), self.train(1, 4, "cuda", tag="one"),
                          1e-4, "one process, cuda against cpu")

    def test_bf16_against_the_cpu(self):
        bf16 = ["--precision", "bf16"]
        self.assert_close(self.train(1, 4, "cpu", bf16, tag="bf16"),
                          self.train(1, 4, "cuda", bf16, tag="bf16"), 1e-4,
                          "one process, bf16, cuda against cpu")

    def test_options_on_one_gpu(self):
        """What changes the kernels a step runs, against the plain GPU run, in fp32 and bf16:
        --recompute (each block's forward again in backward: the same kernels on the same
        inputs, so the same losses bit for bit), --profile (timed events around each kernel:
        bit for bit, and the products test_profile.py expects), --attention materialized (the (T, T)
        probabilities kept instead of the flash kernels: within 1e-4), and a checkpoint written
        half way and resumed (the state through the host and back: bit for bit)."""
        for prec in ("fp32", "bf16"):
            p = ["--precision", prec]
            ref = self.train(1, 4, "cuda", p, tag="opt_ref_" + prec)
            with self.subTest(prec + " --recompute"):
                self.assertEqual(ref, self.train(1, 4, "cuda", p + ["--recompute"],
                                                 tag="opt_rc_" + prec))
            with self.subTest(prec + " --attention materialized"):
                got = self.train(1, 4, "cuda", p + ["--attention", "materialized"],
                                 tag="opt_mat_" + prec)
                self.assert_close(ref, got, 1e-4, prec + " materialized against flash")
            with self.subTest(prec + " --profile"):
                # the GPU's timed events around every kernel change nothing
                trace = os.path.join(self.tmp, "opt_prof_%s.trace.json" % prec)
                self.assertEqual(ref, self.train(1, 4, "cuda", p + ["--profile", "2:2",
                                                                    "--profile-trace", trace],
                                                 tag="opt_prof_" + prec))
                metrics = os.path.join(self.tmp, "opt_prof_%s_cuda_w1.jsonl" % prec)
                suffix = "_bf16" if prec == "bf16" else ""
                want = {k + suffix: v for k, v in
                        test_profile.expected_products("flash", padded_head=True).items()}
                prof = test_profile.read_profile(metrics)[0]
                test_profile.check_profile(self, prof, want, (2, 3), "cuda:0")
                test_profile.check_trace(self, trace, prof)  # the timed events' placement
            with self.subTest(prec + " DISTRAIN_CUDA_GEMM_TUNE=1"):
                # each kind of product on the fastest of cuBLASLt's candidates, timed on its
                # first product: the timing runs leave every output as it was (the emulated
                # candidates compute alike: bit for bit; a GPU's sum in other orders)
                got = self.train(1, 4, "cuda", p, tag="opt_tune_" + prec,
                                 env={"DISTRAIN_CUDA_GEMM_TUNE": "1"})
                if EMULATED:
                    self.assertEqual(ref, got)
                else:
                    self.assert_close(ref, got, 1e-4, prec + " tuned GEMMs")
                self.assertRegex(self.logs[0], r"GEMM m=\d+ n=\d+ k=\d+ .*by timing")
            with self.subTest(prec + " resume"):
                ckpt = ["--ckpt-dir", os.path.join(self.tmp, "ckpt_" + prec)]
                first = self.train(1, 4, "cuda", p + ckpt + ["--stop-at", str(STEPS // 2)],
                                   tag="opt_stop_" + prec)
                rest = self.train(1, 4, "cuda", p + ckpt + ["--resume"], tag="opt_res_" + prec)
                self.assertEqual(ref, first + rest)
        with self.subTest("bf16 DISTRAIN_CUDA_WGMMA=1"):
            # the bf16 flash kernels on Hopper's wgmma, at head size 64 (a model of its own: the
            # golden one's heads are 16): bit for bit on the emulated GPU, whose wgmma sums in
            # mma.sync's order; within 1e-4 on a GPU of compute capability 9.0; refused on another
            m = ["--precision", "bf16", "--init", "seed:1", "--layers", "2", "--heads", "2",
                 "--channels", "128", "--vocab", "100", "--max-seq", "32"]
            ref = self.train(1, 4, "cuda", m, tag="opt_wg_ref")
            _, outs = self.launch(1, 4, "cuda", m, "opt_wg", env={"DISTRAIN_CUDA_WGMMA": "1"})
            if outs[0][0] != 0 and "needs a GPU of compute capability 9.0" in outs[0][2]:
                self.assertFalse(EMULATED, "the emulated GPU is 9.0")
            else:
                got = self.train(1, 4, "cuda", m, tag="opt_wg", env={"DISTRAIN_CUDA_WGMMA": "1"})
                if EMULATED:
                    self.assertEqual(ref, got)
                else:
                    self.assert_close(ref, got, 1e-4, "bf16 on wgmma")

    def test_head_size_past_the_flash_kernels_refused(self):
        """Head size 256, past the GPU flash kernels' 128: refused at start-up, before any step,
        naming the way out; the same model trains with --attention materialized."""
        argv = [dp.trainer(), "--init", "seed:1", "--layers", "1", "--heads", "1", "--channels",
                "256", "--vocab", "100", "--max-seq", "32", "--train",
                os.path.join(dp.GOLDEN, "tiny_train.bin"), "--seq", "32", "--batch", "1",
                "--steps", "1", "--device", "cuda"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 1, p.stderr[-2000:])
        self.assertIn("take head sizes up to 128, the model's is 256", p.stderr)
        self.assertNotIn("| loss", p.stderr)
        p = subprocess.run(argv + ["--attention", "materialized"], capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])

    def evaluate(self, world, device, extra, tag):
        """Per-completion summed losses of a multiple-choice eval of the golden model (--steps
        0), row by row."""
        import test_eval  # noqa: E402  (llm.c's eval format)
        evalset = os.path.join(self.tmp, "eval.bin")
        if not os.path.exists(evalset):
            test_eval.write_evalfile(evalset, test_eval.random_examples(5, 10))
        out = os.path.join(self.tmp, "evalout_%s_%s_w%d.jsonl" % (tag, device, world))
        if os.path.exists(out):  # --eval-out appends
            os.remove(out)
        self.train(world, 4, device, ["--steps", "0", "--eval", evalset, "--eval-out", out]
                   + list(extra), tag="eval_" + tag)
        return [x for e in sorted(test_eval.read_eval_out(out)[0]) for x in e[2]]

    def test_eval_against_the_cpu(self):
        """The multiple-choice evaluation's losses, read back from the GPU per token: fp32
        within 1e-4 of the CPU, bf16 within 1e-3 (sums of up to 33 tokens' losses, each from
        bf16 logits whose roundings may fall apart by one bf16 step on the two devices); tp=2
        sharing the GPU within 1e-5 of one GPU process."""
        for prec, tol in (("fp32", 1e-4), ("bf16", 1e-3)):
            with self.subTest(prec):
                extra = ["--precision", prec]
                self.assert_close(self.evaluate(1, "cpu", extra, prec),
                                  self.evaluate(1, "cuda", extra, prec), tol,
                                  "eval %s, cuda against cpu" % prec)
        self.assert_close(self.evaluate(1, "cuda", [], "fp32"),
                          self.evaluate(2, "cuda", ["--tp", "2"], "tp2"), 1e-5, "eval tp=2")

    def test_blend_losses_by_source(self):
        """A blend's loss by source (the per-token losses the GPU's mean loss was read back
        from, summed by each row's source): one GPU within 1e-4 of the CPU, and pp=2 (the last
        stage's, sent to the first) sharing the GPU within 1e-5 of one GPU process."""
        train = os.path.join(dp.GOLDEN, "tiny_train.bin")
        blend = ["--train", "3:web=%s,1:%s" % (train, train)]

        def sources(world, device, extra, tag):
            metrics, outs = self.launch(world, 4, device, blend + extra, tag)
            dp.assert_ranks_ok(outs, tag)
            got = [m["loss_sources"] for m in dp.read_metrics(metrics)]
            self.assertEqual([list(g) for g in got], [["web", "src2"]] * len(got), tag)
            return [g["web"] for g in got] + [g["src2"] for g in got]

        one = sources(1, "cuda", [], "src_gpu")
        self.assert_close(sources(1, "cpu", [], "src_cpu"), one, 1e-4, "by source, cuda vs cpu")
        self.assert_close(one, sources(2, "cuda", ["--pp", "2"], "src_pp2"), 1e-5,
                          "by source, pp=2")

    def test_sample_with_the_key_value_cache(self):
        """Text generation through the key/value cache (the prompt's 32 tokens in one forward,
        then one row a token: the attention kernels' queries at q0 = 32, 33, ... of the cached
        keys) against whole windows (--sample-no-cache), greedy, on past the 64-token window
        (where the cache gives way to sliding windows): the same tokens in fp32 (flash and
        materialized) and bf16 (the mma kernels, and at head size 64 on wgmma where the GPU is
        9.0). The model is trained on the CPU on a cycle through 100 tokens, so that its next
        token depends on the context. On a GPU, bf16's one-row GEMMs may sum in another order
        than the window's and move a logit by a bf16 step: there the tokens must agree up to
        the first near-tie only, and that at least 16 tokens in (the emulated GPU sums alike:
        all of them)."""
        from test_blend import write_shard  # noqa: E402  (llm.c's token shard)
        shard, model = os.path.join(self.tmp, "cycle.bin"), os.path.join(self.tmp, "cycle_%d.bin")
        order = list(range(100))
        random.Random(1).shuffle(order)
        write_shard(shard, [order[i % 100] for i in range(20000)])

        def sample(heads, extra, env, tag, world=1):
            """The sample's tokens (rank 0's), or None where wgmma needs another GPU."""
            if not os.path.exists(model % heads):
                p = subprocess.run([dp.trainer(), "--device", "cpu", "--train", shard, "--layers",
                                    "2", "--heads", str(heads), "--channels", "128", "--vocab",
                                    "100", "--max-seq", "64", "--batch", "4", "--seq", "64",
                                    "--steps", "30", "--lr", "1e-2", "--init", "seed:1",
                                    "--threads", "1", "--quiet", "--export-llmc", model % heads],
                                   capture_output=True, text=True, timeout=300)
                self.assertEqual(p.returncode, 0, p.stderr[-2000:])
            argv = [dp.trainer(), "--steps", "0", "--init", "llmc:" + model % heads, "--device",
                    "cuda", "--val", shard, "--batch", "1", "--seq", "64", "--sample", "40",
                    "--sample-top-k", "1", "--threads", "1"] + extra
            if world == 1:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                   env=dict(os.environ, **env))
            else:  # every rank on GPU 0
                kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
                outs = dp.wait_all(dp.launch(world, lambda r: argv, kv,
                                             lambda r: dict(env, LOCAL_RANK="0")), timeout=300)
                dp.assert_ranks_ok(outs, tag)
                p = subprocess.CompletedProcess(argv, *outs[0])
            if p.returncode != 0 and "needs a GPU of compute capability 9.0" in p.stderr:
                self.assertFalse(EMULATED, "the emulated GPU is 9.0")
                return None
            self.assertEqual(p.returncode, 0, "%s: %s" % (tag, p.stderr[-2000:]))
            self.assertEqual("sample: a key/value cache of 64 positions" in p.stderr,
                             "--sample-no-cache" not in extra, tag + ": " + p.stderr[-2000:])
            m = re.search(r"---- sample \(.*\) ----\n(.*)\n---- end of sample ----", p.stdout, re.S)
            self.assertIsNotNone(m, tag + ": " + p.stdout[-2000:])
            toks = re.findall(r"\[(\d+)\]", m.group(1))
            self.assertEqual(len(toks), 32 + 40, tag)  # the prompt: --val's first 32 tokens
            return toks[32:]

        for heads, prec, attn in ((4, "fp32", "flash"), (4, "fp32", "materialized"),
                                  (4, "bf16", "flash"), (2, "bf16", "wgmma")):
            tag = "sample_%s_%s" % (prec, attn)
            with self.subTest(tag):
                extra = ["--precision", prec, "--attention", "materialized" if attn ==
                         "materialized" else "flash"]
                env = {"DISTRAIN_CUDA_WGMMA": "1"} if attn == "wgmma" else {}
                got = sample(heads, extra, env, tag)
                if got is None:
                    continue
                want = sample(heads, extra + ["--sample-no-cache"], env, tag + "_whole")
                self.assertGreater(len(set(got)), 1, tag)  # the context matters
                if prec == "fp32" or EMULATED:
                    self.assertEqual(got, want, tag)
                else:
                    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), 40)
                    self.assertGreaterEqual(agree, 16, "%s: %s vs %s" % (tag, got, want))
                if attn == "flash" and prec == "bf16":  # cp=2: each rank the one GPU's forwards
                    self.assertEqual(sample(heads, extra + ["--cp", "2"], env, tag + "_cp2", 2),
                                     got, tag + " under cp=2")

    def test_layouts_on_one_gpu(self):
        for world, dps, extra in ((2, 2, ["--zero-stage", "3"]), (2, 2, ["--zero-stage", "2"]),
                                  (2, 1, ["--tp", "2"]), (2, 1, ["--tp", "2", "--sp"]),
                                  (2, 1, ["--pp", "2"]),
                                  (4, 2, ["--cp", "2", "--zero-stage", "1"])):
            what = "world %d %s" % (world, " ".join(extra))
            with self.subTest(what):
                ref = self.train(1, 4 * dps, "cuda", tag="ref%d" % dps)
                got = self.train(world, 4, "cuda", extra, tag="_".join(e.strip("-") for e in extra))
                self.assert_close(ref, got, 1e-5, what)
                self.assertIn("collectives stage through the host", self.logs[0])
                if "--zero-stage" in extra:  # on a GPU the comm thread is on under every stage
                    self.assertIn("collectives on a comm thread, overlapped", self.logs[0])

    def test_bf16_layouts_on_one_gpu(self):
        """bf16 in layouts that change how the bf16 weight copy is kept (ZeRO-1's gather, then
        one rounding pass; ZeRO-3's gathered weights rounded per layer) and split the MLP whose
        input gradient goes through the GELU in the GEMM's epilogue (tp=2)."""
        bf16 = ["--precision", "bf16"]
        for world, dps, extra in ((2, 2, ["--zero-stage", "1"]), (2, 2, ["--zero-stage", "3"]),
                                  (2, 1, ["--tp", "2"])):
            what = "bf16 world %d %s" % (world, " ".join(extra))
            with self.subTest(what):
                ref = self.train(1, 4 * dps, "cuda", bf16, tag="bf16ref%d" % dps)
                got = self.train(world, 4, "cuda", bf16 + extra,
                                 tag="bf16_" + "_".join(e.strip("-") for e in extra))
                self.assert_close(ref, got, 1e-4, what)

    def test_bf16_tp_dlogits_in_place(self):
        """Under bf16 the vocabulary-parallel cross-entropy writes each rank's dlogits as bf16
        values in place, as the fused one does, so the LM head's backward GEMMs read them where
        they are instead of rounding a copy into the kernel scratch: with a vocabulary of 20000
        over tp=2, that copy (128 rows x 10000 columns x 2 bytes, 2.4 MiB) would outgrow the
        1 MiB scratch that everything else here needs."""
        argv = ["--init", "seed:1", "--vocab", "20000", "--precision", "bf16", "--tp", "2",
                "--steps", "2"]
        self.train(2, 4, "cuda", argv, tag="bf16_tp2_v20000")
        for r, log in enumerate(self.logs):
            scratch = float(re.search(r"kernel scratch ([\d.]+) MiB", log).group(1))
            self.assertLessEqual(scratch, 1.0, "rank %d: kernel scratch %.1f MiB" % (r, scratch))

    def test_nccl_refused_on_a_shared_gpu(self):
        _, outs = self.launch(2, 4, "cuda", ["--comm", "nccl"], "shared")
        if any("was built without NCCL" in err for _, _, err in outs):
            self.skipTest("this build has no NCCL backend")
        for r, (rc, _, err) in enumerate(outs):
            self.assertNotEqual(rc, 0, "rank %d trained on NCCL sharing a GPU" % r)
            self.assertIn("--comm nccl: ranks 0 and 1 share one GPU, which NCCL refuses", err)

    def test_nccl_one_gpu_per_rank(self):
        """One GPU per rank on NCCL. The world-4 layouts run the data-parallel comm thread
        next to the compute thread's tp or pp operations, each on its own communicator: the
        trainer must not let both have an operation in flight on a GPU (dp.h,
        dt_dp_order_before), which the emulated NCCL refuses."""
        if gpu_count() < 2:
            self.skipTest("NCCL between trainers needs two GPUs")
        for world, dps, extra in ((2, 2, ["--zero-stage", "3"]), (2, 1, ["--tp", "2"]),
                                  (2, 1, ["--pp", "2"]), (4, 2, ["--tp", "2", "--zero-stage", "3"]),
                                  (4, 2, ["--pp", "2", "--zero-stage", "2"])):
            what = "nccl world %d %s" % (world, " ".join(extra))
            with self.subTest(what):
                if gpu_count() < world:
                    self.skipTest("%d GPUs" % world)
                ref = self.train(1, 4 * dps, "cuda", tag="nref%d" % dps)
                got = self.train(world, 4, "cuda", ["--comm", "nccl"] + extra, own_gpus=True,
                                 tag="nccl_" + "_".join(e.strip("-") for e in extra))
                self.assert_close(ref, got, 1e-5, what)
                self.assertIn("collectives: nccl on %d ranks" % world, self.logs[0])

    def test_profile_communication(self):
        """--profile times the communication on a GPU too: tp=2 on NCCL (a GPU per rank), whose
        all-reduces sit between the kernels' timed events on the compute stream, 4L + 2 of the
        residual stream per micro-batch (test_profile.py); dp=2 on one GPU through the host,
        whose gradient all-reduces run on the comm thread, overlapped, P floats a step."""
        act = test_profile.B * test_profile.T * test_profile.C * 4
        runs = [("cpu", 1, ["--zero-stage", "1"])]
        if gpu_count() >= 2:
            runs.insert(0, ("nccl", 2, ["--tp", "2", "--comm", "nccl"]))
        for comm, gpus, extra in runs:
            with self.subTest(comm):
                trace = os.path.join(self.tmp, "comm_%s.%%r.json" % comm)
                metrics, outs = self.launch(2, 4, "cuda", extra + ["--profile", "2",
                                                                   "--profile-trace", trace],
                                            "prof_" + comm, own_gpus=gpus == 2)
                dp.assert_ranks_ok(outs, comm)
                prof = test_profile.read_profile(metrics)[0]
                for r in range(2):
                    ev = test_profile.check_comm(self, trace.replace("%r", str(r)), prof, r)
                    if comm == "nccl":
                        self.assertEqual(len(test_profile.comm_spans(
                            ev, r"comm world all_reduce", act)),
                            test_profile.ACCUM * (4 * test_profile.L + 2))
                if comm == "cpu":
                    rows = {(c["op"], c["overlapped"]): c for c in prof["comm"]}
                    self.assertEqual(rows["all_reduce", True]["mbytes"] * 1e6,
                                     4 * test_profile.param_count(outs[0][2]))

    def test_nccl_peer_stalls(self):
        """Two trainers on NCCL, one GPU each; rank 1 is stopped (SIGSTOP: a wedged process,
        its sockets open) in the middle of training. Rank 0's next NCCL operation, on the
        data-parallel comm thread (ZeRO-3 gathers and reduce-scatters) or on the compute thread
        (ZeRO-0's norm and loss), must give up at the communicator's timeout and the trainer
        exit with the error, not hang in the GPU's wait for its peer."""
        if gpu_count() < 2:
            self.skipTest("NCCL between trainers needs two GPUs")
        for zero in (0, 3):
            with self.subTest(zero=zero):
                tag = "stall_z%d" % zero
                metrics = os.path.join(self.tmp, tag + ".jsonl")
                kv = tempfile.mkdtemp(prefix="kv_", dir=self.tmp)
                argv = dp.base_args(4, ACCUM, metrics, 100000) + [
                    "--device", "cuda", "--comm", "nccl", "--zero-stage", str(zero)]
                env = {"DISTRAIN_COMM_TIMEOUT_MS": "3000"}
                if EMULATED:
                    env["DT_EMUL_GPUS"] = "2"
                procs = dp.launch(2, lambda r: argv, kv, lambda r: dict(env, LOCAL_RANK=str(r)))
                try:
                    deadline = time.time() + 120
                    while time.time() < deadline and procs[0].poll() is None and not (
                            os.path.exists(metrics) and len(dp.read_metrics(metrics)) >= 2):
                        time.sleep(0.05)
                    self.assertGreaterEqual(len(dp.read_metrics(metrics)), 2,
                                            "training never started")
                    procs[1].send_signal(signal.SIGSTOP)
                    t0 = time.time()
                    _, err = procs[0].communicate(timeout=60)
                    elapsed = time.time() - t0
                finally:
                    for p in procs:
                        p.kill()
                        p.communicate()
                self.assertNotEqual(procs[0].returncode, 0, "rank 0 finished without its peer")
                self.assertLess(elapsed, 3.0 + 10.0, "rank 0 gave up after %.1f s" % elapsed)
                self.assertRegex(err, r"comm world \(\S+\) rank 0/2: [\w-]+ timed out after "
                                 r"3000 ms \(a peer is missing or stalled\)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--trainer", help="the distrain-train to run (default: the build's); "
                    "tests/emul's distrain-train-emul runs the CUDA trainer on the CPU")
    args, rest = ap.parse_known_args()
    dp.BUILD = os.path.abspath(args.build)
    if args.trainer:
        dp.trainer = lambda: os.path.abspath(args.trainer)
        EMULATED = "emul" in os.path.basename(args.trainer)
        if EMULATED:
            STEPS = 5
    if not has_gpu():
        print("no usable CUDA GPU (or a build without CUDA): skipped", file=sys.stderr)
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
