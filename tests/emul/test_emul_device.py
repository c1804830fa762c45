"""The CUDA device's start-up errors, through the real trainer on machines the emulated GPU
(tests/emul/cuda_host.cc) can be made to be: a GPU too full to start, one too small for the
model, no GPU, and a driver older than the runtime. Each --device cuda run must end with exit 1
and one error naming the cause and the way out, before any step; --device auto must fall back
to the CPU where there is no usable GPU (warning when a driver is present but too old).

    /usr/bin/python3 tests/emul/test_emul_device.py --trainer build/tests/emul/distrain-train-emul
"""

import argparse
import os
import subprocess
import sys
import unittest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "numerics", "golden")
TRAINER = None


def run(device, env):
    argv = [TRAINER, "--init", "llmc:" + os.path.join(GOLDEN, "tiny_model.bin"), "--train",
            os.path.join(GOLDEN, "tiny_train.bin"), "--seq", "32", "--batch", "4", "--steps", "1",
            "--threads", "1", "--device", device]
    return subprocess.run(argv, env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=300)


class EmulatedDevice(unittest.TestCase):
    def refused(self, env, *phrases):
        p = run("cuda", env)
        self.assertEqual(p.returncode, 1, p.stderr[-2000:])
        self.assertNotIn("| loss", p.stderr)
        for phrase in phrases:
            self.assertIn(phrase, p.stderr)

    def test_gpu_full_at_start(self):
        """6 MiB: cuBLASLt's 32 MiB workspace, made with the device, does not fit. Nothing of
        the model is allocated yet, so the advice is about the GPU, not the job."""
        self.refused({"DT_EMUL_GPU_MEM": "6M"}, "out of GPU memory for cuBLASLt's workspace",
                     "6.0 MiB free of 6.0 MiB", "another process may hold its memory")

    def test_gpu_too_small_for_the_activations(self):
        """34 MiB: the device and the weights fit, the activations do not: the job's knobs."""
        self.refused({"DT_EMUL_GPU_MEM": "34M"}, "out of GPU memory for activation",
                     "enable activation checkpointing (--recompute)")

    def test_no_gpu(self):
        self.refused({"DT_EMUL_GPUS": "0"}, "--device cuda: no usable CUDA GPU")
        p = run("auto", {"DT_EMUL_GPUS": "0"})
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("device cpu,", p.stderr)

    def test_driver_older_than_the_runtime(self):
        env = {"DT_EMUL_DRIVER_VERSION": "12000"}
        self.refused(env, "--device cuda: CUDA driver supports up to 12.0, the runtime is 13.0")
        p = run("auto", env)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("update the NVIDIA driver", p.stderr)
        self.assertIn("training on the CPU", p.stderr)
        self.assertIn("device cpu,", p.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", required=True)
    args, rest = ap.parse_known_args()
    TRAINER = os.path.abspath(args.trainer)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
