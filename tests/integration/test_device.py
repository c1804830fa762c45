"""The trainer's GPU code paths, on a CPU: --device cpu-remote against --device cpu.

The remote CPU device (kernels/device.h) runs the CPU kernels on memory whose pointers fault
if the host dereferences them, exactly as a GPU's would, so every path a GPU trainer takes
through the host is exercised here: token and loss staging in the model, device-to-host
checkpoint shards and their host-to-device load, export, sampling, the multiple-choice
evaluation's per-token losses, and the host-staged
communicator (dt_comm_set_device) under data, tensor, pipeline and context parallelism. The
kernels and the reduction orders are the CPU's in both runs, so every loss, every checkpoint
byte and the exported weights must be bit-identical; a host access to device memory crashes
the run.

    /usr/bin/python3 tests/integration/test_device.py --build build
"""

import argparse
import filecmp
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "numerics", "golden")
BUILD = "build"


def trainer():
    return os.path.join(BUILD, "worker", "trainer", "distrain-train")


def args(device, out, steps=6, extra=(), init=True):
    start = ["--init", "llmc:" + os.path.join(GOLDEN, "tiny_model.bin")] if init else []
    return [trainer(), "--device", device] + start + [
            "--train", os.path.join(GOLDEN, "tiny_train.bin"),
            "--val", os.path.join(GOLDEN, "tiny_val.bin"), "--val-every", "3", "--val-batches", "2",
            "--seq", "32", "--batch", "4", "--grad-accum", "2", "--steps", str(steps),
            "--lr", "1e-3", "--schedule", "cosine", "--warmup", "2", "--weight-decay", "0.1",
            "--grad-clip", "1.0", "--threads", "1", "--quiet",
            "--metrics", os.path.join(out, "metrics.jsonl")] + list(extra)


def run(world, argv_for_rank, kv, timeout=180):
    """Runs world ranks (rendezvous in directory kv); fails with each rank's stderr tail."""
    procs = []
    for r in range(world):
        env = dict(os.environ, WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r),
                   DISTRAIN_KV_DIR=kv, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv_for_rank(r), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline, outs = time.time() + timeout, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.time())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("ranks still running after %d s" % timeout)
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise AssertionError("rank %d exited %d:\n%s" % (r, p.returncode, outs[r][1][-3000:]))
    return [o[0] for o in outs]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class RemoteDevice(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="dt_device_")
        # a multiple-choice eval, whose per-token losses come back from the device too
        cls.evalset = os.path.join(cls.tmp, "eval.bin")
        sys.path.insert(0, HERE)
        import test_eval  # noqa: E402
        test_eval.write_evalfile(cls.evalset, test_eval.random_examples(11, 12))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def both(self, tag, world, extra=(), steps=6, sample=True):
        """Runs the job on both devices (sampling text at the end unless the layout cannot);
        returns their output directories."""
        dirs = {}
        for device in ("cpu", "cpu-remote"):
            out = os.path.join(self.tmp, "%s_%s" % (tag, device))
            os.makedirs(out)
            dirs[device] = out
            stdout = run(world, lambda r: args(device, out, steps, [
                "--ckpt-dir", os.path.join(out, "ckpt"), "--save-every", "3",
                "--export-llmc", os.path.join(out, "model.bin"), "--eval", self.evalset,
                "--eval-every", "3", "--eval-out", os.path.join(out, "eval.jsonl")]
                + (["--sample", "8"] if sample else []) + list(extra)),
                os.path.join(out, "kv"))
            with open(os.path.join(out, "sample.txt"), "w") as f:
                f.write(stdout[0])
        return dirs["cpu"], dirs["cpu-remote"]

    def assert_same(self, cpu, remote, what):
        a, b = metrics(cpu), metrics(remote)
        self.assertTrue(any("loss" in m for m in a), what + ": no steps recorded")
        for m in a + b:  # timings differ run to run
            for k in ("ms", "tokens_per_s", "comm_ms", "bubble", "tflops", "mfu"):
                m.pop(k, None)
        self.assertEqual(a, b, what + ": metrics differ")
        self.assertTrue(filecmp.cmp(os.path.join(cpu, "model.bin"),
                                    os.path.join(remote, "model.bin"), shallow=False),
                        what + ": exported weights differ")
        shards = sorted(glob.glob(os.path.join(cpu, "ckpt", "step-*", "shard-*")))
        self.assertTrue(shards, what + ": no checkpoint shards")
        for s in shards:
            twin = os.path.join(remote, os.path.relpath(s, cpu))
            self.assertTrue(filecmp.cmp(s, twin, shallow=False), what + ": %s differs" % twin)
        self.assertTrue(any("eval_acc_norm" in m for m in a), what + ": no evaluation recorded")
        self.assertTrue(filecmp.cmp(os.path.join(cpu, "eval.jsonl"),
                                    os.path.join(remote, "eval.jsonl"), shallow=False),
                        what + ": the evaluation's losses differ")
        with open(os.path.join(cpu, "sample.txt")) as f, \
                open(os.path.join(remote, "sample.txt")) as g:
            self.assertEqual(f.read(), g.read(), what + ": samples differ")

    def test_one_process(self):
        self.assert_same(*self.both("single", 1), "one process")

    def test_data_parallel_zero(self):
        for zero in (1, 3):
            with self.subTest(zero=zero):
                self.assert_same(*self.both("dp_z%d" % zero, 2, ["--zero-stage", str(zero)]),
                                 "dp=2 ZeRO-%d" % zero)

    def test_tensor_parallel(self):
        self.assert_same(*self.both("tp", 2, ["--tp", "2", "--sp"], sample=False), "tp=2 with sp")

    def test_pipeline_parallel(self):
        self.assert_same(*self.both("pp", 2, ["--pp", "2"]), "pp=2 1F1B")

    def test_context_parallel(self):
        self.assert_same(*self.both("cp", 4, ["--cp", "2", "--zero-stage", "1"], sample=False),
                         "cp=2 x dp=2 ZeRO-1")

    def test_resume_across_devices(self):
        """A checkpoint written on the CPU resumes on the remote device (and so on a GPU's
        code path) and continues the CPU's trajectory exactly."""
        cpu, _ = self.both("resume_ref", 1)
        out = os.path.join(self.tmp, "resumed")
        shutil.copytree(os.path.join(cpu, "ckpt"), os.path.join(out, "ckpt"))
        shutil.rmtree(os.path.join(out, "ckpt", "step-00000006"))
        run(1, lambda r: args("cpu-remote", out, 6, ["--ckpt-dir", os.path.join(out, "ckpt"),
                                                      "--resume"], init=False),
            os.path.join(out, "kv"))
        ref = [m["loss"] for m in metrics(cpu) if m.get("step", 0) > 3 and "loss" in m]
        got = [m["loss"] for m in metrics(out) if "loss" in m]
        self.assertEqual(ref, got)

    def test_bad_device(self):
        p = subprocess.run(args("tpu", self.tmp), capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--device tpu: expected cpu, cuda or auto", p.stderr)
        # cuda on a machine without a GPU (or a build without CUDA): a refusal that says why.
        if not os.path.exists("/dev/nvidiactl"):
            p = subprocess.run(args("cuda", self.tmp), capture_output=True, text=True)
            self.assertNotEqual(p.returncode, 0)
            self.assertRegex(p.stderr, "no usable CUDA GPU|built without CUDA")

    def test_comm_choice(self):
        """--comm: a bad name, and nccl where a rank has no GPU, are refused before training
        (on every rank of the job); --comm cpu trains as auto does on a CPU."""
        p = subprocess.run(args("cpu", self.tmp, extra=["--comm", "pigeon"]), capture_output=True,
                           text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--comm: expected cpu, nccl or auto", p.stderr)
        out = os.path.join(self.tmp, "comm_nccl")
        os.makedirs(out)
        with self.assertRaises(AssertionError) as e:
            run(2, lambda r: args("cpu-remote", out, extra=["--comm", "nccl"]),
                os.path.join(out, "kv"), timeout=60)
        self.assertRegex(str(e.exception), r"--comm nccl: 2 of 2 ranks cannot use NCCL \(rank 0 "
                         r"cannot: --device cpu-remote is not a GPU\); use --comm cpu|"
                         "built without NCCL")
        outs = {}
        for comm in ("auto", "cpu"):
            outs[comm] = os.path.join(self.tmp, "comm_" + comm)
            os.makedirs(outs[comm])
            run(2, lambda r: args("cpu-remote", outs[comm], steps=3, extra=["--comm", comm]),
                os.path.join(outs[comm], "kv"))
        a, b = metrics(outs["auto"]), metrics(outs["cpu"])
        for m in a + b:
            for k in ("ms", "tokens_per_s", "comm_ms", "bubble", "tflops", "mfu"):
                m.pop(k, None)
        self.assertEqual(a, b)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    a, rest = ap.parse_known_args()
    BUILD = os.path.abspath(a.build)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
