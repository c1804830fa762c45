/* test_cuda.c — CUDA kernels against their CPU references (label "gpu").
 *
 * Exits 77 (skipped) on a machine without a usable GPU, which CTest reports as skipped. With a
 * GPU, the AdamW kernel must match kernels/cpu/adamw.c bit for bit over several steps: both
 * follow PyTorch's formula operation by operation, each rounded on its own (the CPU build does
 * not contract into FMAs, the kernel uses the _rn intrinsics), and sqrt and division are IEEE on
 * both. (A relative tolerance would not do: parameters that cancel to ~0 turn a one-ulp
 * difference of an intermediate into a large relative one.) */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"
#include "cuda_kernels.h"
#include "rng.h"

#define N 100003

START_TEST(test_adamw_matches_cpu)
{
  float *p = malloc(N * sizeof(float)), *g = malloc(N * sizeof(float));
  float *m = calloc(N, sizeof(float)), *v = calloc(N, sizeof(float));
  float *gp = malloc(N * sizeof(float));
  dt_rng_t rng;
  dt_rng_seed(&rng, 3);
  dt_rng_normal(&rng, p, N, 0.0f, 0.1f);
  float *dp, *dg, *dm, *dv;
  ck_assert_int_eq(cudaMalloc((void **)&dp, N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dg, N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dm, N * sizeof(float)), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&dv, N * sizeof(float)), cudaSuccess);
  cudaMemcpy(dp, p, N * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(dm, 0, N * sizeof(float));
  cudaMemset(dv, 0, N * sizeof(float));
  for (int t = 1; t <= 5; t++) {
    dt_rng_normal(&rng, g, N, 0.0f, 1.0f);
    cudaMemcpy(dg, g, N * sizeof(float), cudaMemcpyHostToDevice);
    dt_cpu_adamw_update(p, g, m, v, N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, t);
    ck_assert_int_eq(
        dt_cuda_adamw_update(dp, dg, dm, dv, N, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.7f, t), 0);
  }
  float *gm = malloc(N * sizeof(float)), *gv = malloc(N * sizeof(float));
  ck_assert_int_eq(cudaMemcpy(gp, dp, N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ck_assert_int_eq(cudaMemcpy(gm, dm, N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ck_assert_int_eq(cudaMemcpy(gv, dv, N * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  int differ = 0, first = -1;
  double worst = 0.0;
  for (int i = 0; i < N; i++) {
    if (gp[i] != p[i] || gm[i] != m[i] || gv[i] != v[i]) {
      differ++;
      first = first < 0 ? i : first;
    }
    worst = fmax(worst, fabs((double)gp[i] - p[i]));
  }
  ck_assert_msg(differ == 0,
                "%d of %d elements differ (first [%d]: param %.9g vs %.9g); max |dparam| %.3g",
                differ, N, first, first < 0 ? 0.0 : gp[first], first < 0 ? 0.0 : p[first], worst);
  free(gm), free(gv);
  cudaFree(dp), cudaFree(dg), cudaFree(dm), cudaFree(dv);
  free(p), free(g), free(m), free(v), free(gp);
}
END_TEST

int main(void)
{
  int count = 0;
  if (dt_cuda_device_count(&count) != 0 || count == 0)
    return 77; /* no GPU here: skipped */
  Suite *s = suite_create("cuda");
  TCase *tc = tcase_create("kernels");
  tcase_add_test(tc, test_adamw_matches_cpu);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  /* CUDA is initialised above (the device count): a forked child could not use it. */
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
