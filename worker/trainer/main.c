/* main.c — distrain-train: its flags (args.c), the world the environment describes, then the
 * run (trainer.c). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "args.h"
#include "cpu_kernels.h"
#include "dt_log.h"
#include "dt_util.h"
#include "comm.h"
#include "dt_param.h"
#include "jobspec.h"
#include "link.h"
#include "plan.h"
#include "stop.h"
#include "trainer.h"

/* The mesh the agent assigned (DISTRAIN_MESH), checked against WORLD_SIZE and --tp. */
static int read_mesh(dt_train_opts_t *o, int64_t world)
{
  const char *text = getenv("DISTRAIN_MESH");
  char why[256];
  if (!text || !*text)
    return 0;
  if (dt_plan_parse_mesh(text, &o->mesh, why, sizeof why) != 0) {
    fprintf(stderr, "distrain-train: %s\n", why);
    return DT_EINVAL;
  }
  if (dt_mesh_world(&o->mesh) != world) {
    fprintf(stderr, "distrain-train: DISTRAIN_MESH='%s' has %d ranks but WORLD_SIZE is %lld\n",
            text, dt_mesh_world(&o->mesh), (long long)world);
    return DT_EINVAL;
  }
  if ((o->tp > 0 && o->tp != o->mesh.tp) || (o->pp > 0 && o->pp != o->mesh.pp) ||
      (o->cp > 0 && o->cp != o->mesh.cp)) {
    fprintf(stderr, "distrain-train: --tp/--pp/--cp disagree with DISTRAIN_MESH='%s'\n", text);
    return DT_EINVAL;
  }
  return 0;
}

/* The world described by the environment (WORLD_SIZE, RANK) and its rendezvous store: the
 * coordinator's key-value store (under an agent) or a shared directory (DISTRAIN_KV_DIR). The
 * trainer checks its plan, then joins the world and splits it into tensor- and data-parallel
 * groups. *have_kv: 1 file store, 2 coordinator store. */
static int setup_world(dt_train_opts_t *o, dt_kv_t *kv, int *have_kv, char *prefix,
                       size_t prefixlen)
{
  const char *ws = getenv("WORLD_SIZE"), *rk = getenv("RANK");
  int64_t world = 1, rank = 0;
  if (ws && (dt_parse_i64(ws, &world) != 0 || world < 1)) {
    fprintf(stderr, "distrain-train: WORLD_SIZE='%s' is not a positive integer\n", ws);
    return DT_EINVAL;
  }
  DT_CHECK(read_mesh(o, world));
  if (world == 1)
    return 0;
  if (!rk || dt_parse_i64(rk, &rank) != 0 || rank < 0 || rank >= world) {
    fprintf(stderr, "distrain-train: WORLD_SIZE=%lld needs RANK in [0, %lld)\n", (long long)world,
            (long long)world);
    return DT_EINVAL;
  }
  const char *dir = getenv("DISTRAIN_KV_DIR");
  if (dt_link_has_coordinator(o->link)) {
    DT_CHECK(dt_link_kv(o->link, kv));
    *have_kv = 2;
    snprintf(prefix, prefixlen, "dp");
  } else if (dir && *dir) {
    DT_CHECK(dt_kv_file_create(kv, dir));
    *have_kv = 1;
    const char *p = getenv("DISTRAIN_KV_PREFIX");
    snprintf(prefix, prefixlen, "%s", p && *p ? p : "dp");
  } else {
    fprintf(stderr,
            "distrain-train: WORLD_SIZE=%lld needs a rendezvous store: run under "
            "distrain-worker, or set DISTRAIN_KV_DIR to a directory all ranks share\n",
            (long long)world);
    return DT_EINVAL;
  }
  o->kv = kv;
  o->kv_prefix = prefix;
  o->rank = (int)rank;
  o->world = (int)world;
  char tag[32];
  snprintf(tag, sizeof tag, "rank %lld", (long long)rank);
  dt_log_set_tag(tag);
  return 0;
}

/* OpenBLAS reads OPENBLAS_CORETYPE only when it is loaded: when it took this CPU for a generic
 * one (kernels/cpu/blas.c), run this program again with the variable set, before anything else
 * has started (same pid, arguments and file descriptors). Once at most: the variable is then
 * set, and a value the user set is never overridden. */
static void reexec_for_blas(char **argv)
{
  const char *core = getenv("OPENBLAS_CORETYPE") ? NULL : dt_cpu_blas_better_coretype();
  if (!core)
    return;
  DT_INFO(KERNEL,
          "OpenBLAS does not know this CPU and chose its generic kernels; restarting "
          "with OPENBLAS_CORETYPE=%s",
          core);
  setenv("OPENBLAS_CORETYPE", core, 1);
  execv("/proc/self/exe", argv);
  DT_WARN(KERNEL, "re-executing with OPENBLAS_CORETYPE=%s failed; GEMMs stay on generic kernels",
          core);
}

int main(int argc, char **argv)
{
  dt_train_opts_t o;
  dt_log_init();
  reexec_for_blas(argv);
  if (dt_stop_watch() != 0)
    return 1;
  dt_train_opts_default(&o);
  const int parsed = dt_train_parse_args(argc, argv, &o);
  if (parsed != 0) {
    dt_train_args_free(&o);
    return parsed == 1 ? 0 : DT_TRAIN_EXIT_INPUT; /* 1: --help */
  }
  if (dt_link_open(&o.link) != 0)
    return 1;
  dt_kv_t kv;
  char prefix[160];
  int have_kv = 0, rc = setup_world(&o, &kv, &have_kv, prefix, sizeof prefix);
  if (rc == 0)
    rc = dt_train_run(&o);
  if (rc == DT_TRAIN_STOPPED) /* the agent learns why from the exit status */
    dt_link_error(o.link, "stopped on request after a step, its checkpoint committed");
  else if (rc != 0) {
    char why[512];
    dt_log_last_error(why, sizeof why);
    dt_link_error(o.link, why[0] ? why : dt_strerror(rc));
    fprintf(stderr, "distrain-train: failed: %s\n", dt_strerror(rc));
  }
  if (have_kv == 1)
    dt_kv_file_destroy(&kv);
  dt_link_close(o.link);
  dt_train_args_free(&o);
  return rc == DT_TRAIN_STOPPED ? DT_TRAIN_EXIT_STOPPED : rc != 0;
}
