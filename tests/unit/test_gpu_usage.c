/* test_gpu_usage.c — Check suite for the agent's GPU usage (worker/agent/gpu_usage.c) against a
 * stand-in NVML (fake_nvml.c, loaded from FAKE_NVML): GPUs found by PCI address, memory and
 * utilisation sampled, unknown where NVML has no answer, NVML shut down on destroy; each health
 * problem (uncorrected ECC errors, memory repairs pending or failed, a lost GPU) read as the
 * stand-in reports it, unknown where the GPU lacks the query; and without
 * NVML at all, every GPU unknown and nothing failing. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <check.h>

#include "dt_util.h"
#include "gpu_usage.h"

START_TEST(test_samples_by_pci_address)
{
  /* CUDA's order differs from NVML's: the PCI address, not the position, matches them. */
  const char *ids[] = {"0000:86:00.0", "0000:3B:00.0", "0000:AF:00.0"};
  dt_gpu_usage_t *u = NULL;
  ck_assert_int_eq(dt_gpu_usage_create(&u, FAKE_NVML, ids, 3), 0);
  ck_assert_ptr_nonnull(u);
  dt_gpu_sample_t s;
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(s.known);
  ck_assert_uint_eq(s.total_bytes, 40ull << 30);
  ck_assert_uint_eq(s.used_bytes, 1ull << 30);
  ck_assert_int_eq(s.utilization_pct, -1); /* NOT_SUPPORTED */
  ck_assert(dt_gpu_usage_sample(u, 1, &s));
  ck_assert_uint_eq(s.total_bytes, 80ull << 30);
  ck_assert_uint_eq(s.used_bytes, 12ull << 30);
  ck_assert_int_eq(s.utilization_pct, 87);
  ck_assert(!dt_gpu_usage_sample(u, 2, &s)); /* NVML does not know it */
  ck_assert(!s.known);
  ck_assert_int_eq(s.utilization_pct, -1);
  ck_assert(!dt_gpu_usage_sample(u, 3, &s)); /* out of range */
  ck_assert(!dt_gpu_usage_sample(u, -1, &s));

  /* The same library, so the stand-in's counters: initialised once, shut down by destroy. */
  void *lib = dlopen(FAKE_NVML, RTLD_NOW | RTLD_LOCAL);
  ck_assert_ptr_nonnull(lib);
  const int *inits = dlsym(lib, "fake_nvml_inits"), *shutdowns = dlsym(lib, "fake_nvml_shutdowns");
  ck_assert(inits && shutdowns);
  ck_assert_int_eq(*inits, 1);
  ck_assert_int_eq(*shutdowns, 0);
  dt_gpu_usage_destroy(u);
  ck_assert_int_eq(*shutdowns, 1);
  dlclose(lib);
}
END_TEST

/* Writes FAKE_NVML_HEALTH's file: the stand-in reads it at every query. */
static void set_health(const char *path, const char *text)
{
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  ck_assert_int_eq(fclose(f), 0);
}

/* A fresh, empty FAKE_NVML_HEALTH file at path (a mkstemp template). */
static void health_file(char *path)
{
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  setenv("FAKE_NVML_HEALTH", path, 1);
}

START_TEST(test_health)
{
  char path[] = "/tmp/test_gpu_usage_XXXXXX";
  health_file(path);
  const char *ids[] = {"0000:3B:00.0", "0000:86:00.0", "0000:00:01.0"};
  dt_gpu_usage_t *u = NULL;
  ck_assert_int_eq(dt_gpu_usage_create(&u, FAKE_NVML, ids, 3), 0);
  dt_gpu_sample_t s;

  /* Healthy: counted and known where supported, unknown (-1, 0) where not. */
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(!s.lost && !s.reset_pending && !s.remap_failed);
  ck_assert_int_eq(s.ecc_uncorrected, 0);
  ck_assert_uint_eq(s.slowdown, 0); /* idle and at its power cap: no trouble */
  ck_assert(dt_gpu_usage_sample(u, 1, &s));
  ck_assert(!s.lost && !s.reset_pending && !s.remap_failed);
  ck_assert_int_eq(s.ecc_uncorrected, -1); /* NOT_SUPPORTED */
  ck_assert_uint_eq(s.slowdown, 0);

  /* Each problem as NVML reports it, the volatile uncorrected count read (not another). */
  set_health(path, "0000:3B:00.0 ecc=2\n0000:00:01.0 pending=1\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_int_eq(s.ecc_uncorrected, 2);
  ck_assert(!s.reset_pending && !s.remap_failed && !s.lost);
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert(s.reset_pending && !s.remap_failed);
  ck_assert_int_eq(s.ecc_uncorrected, 0);
  set_health(path, "0000:00:01.0 failed=1\n0000:3B:00.0 retired=1\n");
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert(s.remap_failed && !s.reset_pending);
  ck_assert(dt_gpu_usage_sample(u, 0, &s)); /* page retirement pending (pre-Ampere) */
  ck_assert(s.reset_pending && !s.remap_failed);
  ck_assert_int_eq(s.ecc_uncorrected, 0);

  /* Clocks slowed: the reasons of trouble only (hardware slowdown, hardware thermal). */
  set_health(path, "0000:3B:00.0 slow=0x48\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_uint_eq(s.slowdown, 0x48);
  ck_assert(!s.reset_pending && !s.remap_failed && !s.lost);
  ck_assert_int_eq(s.ecc_uncorrected, 0);

  /* Xid events: an application's ignored, a critical one kept (logged) while the agent runs,
   * whatever the next samples say; "0000:86:00.0" has none. */
  set_health(path, "0000:00:01.0 xid=13\n0000:86:00.0 xid=79\n");
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert_int_eq(s.xid, 0);
  ck_assert(dt_gpu_usage_sample(u, 1, &s));
  ck_assert_int_eq(s.xid, 0);
  set_health(path, "0000:00:01.0 xid=79\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s)); /* any GPU's sample takes the events */
  ck_assert_int_eq(s.xid, 0);
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert_int_eq(s.xid, 79);
  set_health(path, "");
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert_int_eq(s.xid, 79);
  ck_assert(!s.lost && !s.reset_pending && !s.remap_failed);
  for (unsigned long long x = 0; x < 200; x++)
    ck_assert_int_eq(dt_gpu_usage_app_xid(x),
                     x == 13 || x == 31 || x == 43 || x == 45 || x == 68 || x == 109);

  /* Lost: reported (sample returns 1) with its memory unknown. */
  set_health(path, "0000:3B:00.0 lost=1\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(s.lost);
  ck_assert(!s.known);
  ck_assert_uint_eq(s.total_bytes, 0);
  ck_assert(dt_gpu_usage_sample(u, 2, &s)); /* the others are as before */
  ck_assert(!s.lost && s.known);

  dt_gpu_usage_destroy(u);
  unsetenv("FAKE_NVML_HEALTH");
  unlink(path);
}
END_TEST

/* NVLinks: those active at create are watched, and one gone inactive is reported; a link down
 * already at create is not, but a GPU with fewer active links than another is logged. The PCIe
 * width, now and at most, where the GPU reports it. */
START_TEST(test_links)
{
  char path[] = "/tmp/test_gpu_usage_XXXXXX";
  health_file(path);
  set_health(path, "0000:00:01.0 nvlink_down=0x4\n");
  const char *ids[] = {"0000:3B:00.0", "0000:86:00.0", "0000:00:01.0"};
  dt_gpu_usage_t *u = NULL;
  char logp[] = "/tmp/test_gpu_usage_log_XXXXXX"; /* the log of create: stderr */
  const int lf = mkstemp(logp), saved = dup(2);
  ck_assert(lf >= 0 && saved >= 0);
  fflush(stderr);
  dup2(lf, 2);
  ck_assert_int_eq(dt_gpu_usage_create(&u, FAKE_NVML, ids, 3), 0);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char log[4096] = "";
  ck_assert_int_ge(pread(lf, log, sizeof log - 1, 0), 0);
  close(lf);
  unlink(logp);
  ck_assert_msg(strstr(log, "GPU 2 has 17 NVLinks active, another GPU of this node 18: a link "
                            "may be down (nvidia-smi nvlink --status)"),
                "%s", log);
  ck_assert_msg(!strstr(log, "GPU 0 has") && !strstr(log, "GPU 1 has"), "%s", log);
  dt_gpu_sample_t s;
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_uint_eq(s.nvlink_down, 0);
  ck_assert(s.pcie_width == 16 && s.pcie_max_width == 16);
  ck_assert(dt_gpu_usage_sample(u, 1, &s)); /* neither supported */
  ck_assert_uint_eq(s.nvlink_down, 0);
  ck_assert(s.pcie_width == 0 && s.pcie_max_width == 0);
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert_uint_eq(s.nvlink_down, 0); /* link 2 was down at create: not watched */

  set_health(path, "0000:3B:00.0 nvlink_down=0x20021 pcie=8\n0000:00:01.0 nvlink_down=0x6\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_uint_eq(s.nvlink_down, 0x20021);
  ck_assert(s.pcie_width == 8 && s.pcie_max_width == 16);
  ck_assert(!s.lost && !s.reset_pending && s.ecc_uncorrected == 0);
  ck_assert(dt_gpu_usage_sample(u, 2, &s));
  ck_assert_uint_eq(s.nvlink_down, 0x2);
  ck_assert(s.pcie_width == 16);

  set_health(path, ""); /* up again: no longer reported */
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_uint_eq(s.nvlink_down, 0);
  ck_assert(s.pcie_width == 16);
  dt_gpu_usage_destroy(u);
  unsetenv("FAKE_NVML_HEALTH");
  unlink(path);
}
END_TEST

/* Link error rates: unknown until a window (200 ms here, main) has passed, then each counter's
 * rise over the last window scaled to a minute; a counter that went back (reset) counts 0, a
 * GPU without the queries stays unknown. The counters are read once a window: a sample within
 * it repeats the last rates. */
START_TEST(test_link_error_rates)
{
  char path[] = "/tmp/test_gpu_usage_XXXXXX";
  health_file(path);
  set_health(path, "0000:3B:00.0 pcie_replays=5 nvlink_replays=1 nvlink_crc=10\n");
  const char *ids[] = {"0000:3B:00.0", "0000:86:00.0"};
  dt_gpu_usage_t *u = NULL;
  ck_assert_int_eq(dt_gpu_usage_create(&u, FAKE_NVML, ids, 2), 0);
  dt_gpu_sample_t s;
  for (int i = 0; i < 2; i++) {
    ck_assert(dt_gpu_usage_sample(u, i, &s));
    ck_assert(s.pcie_replays_per_min == -1 && s.nvlink_replays_per_min == -1 &&
              s.nvlink_crc_per_min == -1);
  }
  const double t0 = dt_now_ms();
  set_health(path, "0000:3B:00.0 pcie_replays=25 nvlink_replays=3 nvlink_crc=10\n");
  usleep(250 * 1000);
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  const double window = dt_now_ms() - t0; /* at least the sample's window, about as long */
  ck_assert_msg(s.pcie_replays_per_min >= (int64_t)(20 * 60000.0 / (window + 50)) &&
                    s.pcie_replays_per_min <= (int64_t)(20 * 60000.0 / 200 + 1),
                "%lld replays a minute over %.0f ms", (long long)s.pcie_replays_per_min, window);
  ck_assert_msg(llabs(10 * s.nvlink_replays_per_min - s.pcie_replays_per_min) <= 10,
                "%lld NVLink replays a minute to %lld PCIe ones: a tenth of them",
                (long long)s.nvlink_replays_per_min, (long long)s.pcie_replays_per_min);
  ck_assert_int_eq(s.nvlink_crc_per_min, 0);
  const int64_t replays = s.pcie_replays_per_min;
  set_health(path, "0000:3B:00.0 pcie_replays=0 nvlink_replays=3 nvlink_crc=10\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s)); /* within the new window: the same rates */
  ck_assert_int_eq(s.pcie_replays_per_min, replays);
  usleep(250 * 1000);
  ck_assert(dt_gpu_usage_sample(u, 0, &s)); /* reset: 0, not a negative rate */
  ck_assert(s.pcie_replays_per_min == 0 && s.nvlink_replays_per_min == 0);
  /* NVLink 0 goes down (its counters do not answer) and comes back with more replays than it
   * had: unknown over the windows its count is missing from, not a rise out of nothing. */
  set_health(path, "0000:3B:00.0 nvlink_down=0x1\n");
  usleep(250 * 1000);
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(s.nvlink_replays_per_min == -1 && s.nvlink_crc_per_min == -1);
  ck_assert_int_eq(s.pcie_replays_per_min, 0);
  set_health(path, "0000:3B:00.0 nvlink_replays=5 nvlink_crc=10\n");
  usleep(250 * 1000);
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(s.nvlink_replays_per_min == -1 && s.nvlink_crc_per_min == -1);
  usleep(250 * 1000);
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert(s.nvlink_replays_per_min == 0 && s.nvlink_crc_per_min == 0);
  ck_assert(dt_gpu_usage_sample(u, 1, &s)); /* not supported: unknown */
  ck_assert(s.pcie_replays_per_min == -1 && s.nvlink_replays_per_min == -1 &&
            s.nvlink_crc_per_min == -1);
  dt_gpu_usage_destroy(u);
  unsetenv("FAKE_NVML_HEALTH");
  unlink(path);
}
END_TEST

/* --ignore-xids: an Xid the operator named is not kept; another critical one is. */
START_TEST(test_ignored_xids)
{
  char path[] = "/tmp/test_gpu_usage_XXXXXX";
  health_file(path);
  const char *ids[] = {"0000:3B:00.0"};
  dt_gpu_usage_t *u = NULL;
  ck_assert_int_eq(dt_gpu_usage_create(&u, FAKE_NVML, ids, 1), 0);
  dt_gpu_usage_ignore_xids(u, (const int[]){63, 79}, 2);
  dt_gpu_sample_t s;
  set_health(path, "0000:3B:00.0 xid=79\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_int_eq(s.xid, 0);
  set_health(path, "0000:3B:00.0 xid=74\n");
  ck_assert(dt_gpu_usage_sample(u, 0, &s));
  ck_assert_int_eq(s.xid, 74);
  dt_gpu_usage_destroy(u);
  unsetenv("FAKE_NVML_HEALTH");
  unlink(path);
}
END_TEST

START_TEST(test_without_nvml)
{
  const char *ids[] = {"0000:3B:00.0"};
  dt_gpu_usage_t *u = NULL;
  ck_assert_int_eq(dt_gpu_usage_create(&u, "libdt-no-such-nvml.so.1", ids, 1), 0);
  ck_assert_ptr_nonnull(u);
  dt_gpu_sample_t s;
  ck_assert(!dt_gpu_usage_sample(u, 0, &s));
  ck_assert(!s.known);
  ck_assert_int_eq(s.utilization_pct, -1);
  dt_gpu_usage_destroy(u);
  dt_gpu_usage_destroy(NULL);
}
END_TEST

static Suite *gpu_usage_suite(void)
{
  Suite *s = suite_create("gpu_usage");
  TCase *t = tcase_create("nvml");
  tcase_add_test(t, test_samples_by_pci_address);
  tcase_add_test(t, test_health);
  tcase_add_test(t, test_links);
  tcase_add_test(t, test_link_error_rates);
  tcase_add_test(t, test_ignored_xids);
  tcase_add_test(t, test_without_nvml);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  setenv("DISTRAIN_GPU_ERROR_WINDOW_MS", "200", 1); /* test_link_error_rates' windows */
  SRunner *sr = srunner_create(gpu_usage_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
