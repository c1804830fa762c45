/* fuzz_jobspec.c — job specs as users write them: a YAML document applied onto the defaults
 * (dt_jobspec_parse_yaml) or, when the input starts with the line "#set", one distrainctl
 * --set assignment per following line (dt_jobspec_set). Properties, from jobspec.h:
 *  - a rejected document or assignment leaves the spec as it was and says why (one line);
 *  - an accepted spec emits as YAML (dt_jobspec_to_yaml) that parses back to an equal spec;
 *  - a spec that validates has a mesh and, for its dp, a gradient accumulation and a
 *    distrain-train command line (or a clear refusal) that the trainer parses
 *    (dt_train_parse_args) into options it accepts (dt_train_opts_validate), with the spec's
 *    model, batch, schedule and optimizer values: a spec the coordinator takes does not fail
 *    in every trainer it starts. */
#include <string.h>

#include "args.h"
#include "comm.h"
#include "fuzz.h"
#include "jobspec.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
  (void)argc, (void)argv;
  fuzz_setup();
  return 0;
}

static Distrain__V1__JobSpec *fresh(void)
{
  Distrain__V1__JobSpec *s = NULL;
  FUZZ_ASSERT(dt_jobspec_new_default(&s) == 0 && s, "no default spec");
  return s;
}

/* A copy through the wire encoding. */
static Distrain__V1__JobSpec *copy(const Distrain__V1__JobSpec *spec)
{
  const size_t n = distrain__v1__job_spec__get_packed_size(spec);
  uint8_t *buf = malloc(n ? n : 1);
  FUZZ_ASSERT(buf, "out of memory");
  distrain__v1__job_spec__pack(spec, buf);
  Distrain__V1__JobSpec *c = distrain__v1__job_spec__unpack(NULL, n, buf);
  FUZZ_ASSERT(c, "a spec does not unpack from its own encoding");
  free(buf);
  return c;
}

/* Applies each line after "#set" as an assignment; a refused one must change nothing. */
static void apply_sets(Distrain__V1__JobSpec *spec, const char *text)
{
  char err[1024];
  for (const char *line = strchr(text, '\n'); line && *line;) {
    line++;
    const char *end = strchr(line, '\n');
    const size_t n = end ? (size_t)(end - line) : strlen(line);
    char *a = strndup(line, n);
    FUZZ_ASSERT(a, "out of memory");
    Distrain__V1__JobSpec *before = copy(spec);
    if (dt_jobspec_set(spec, a, err, sizeof err) != 0) {
      FUZZ_ASSERT(err[0] != '\0', "--set '%s' refused without a reason", a);
      FUZZ_ASSERT(dt_jobspec_equal(spec, before), "refused --set '%s' changed the spec", a);
    }
    dt_jobspec_free(before);
    free(a);
    line = end;
  }
}

static void trainer_accepts(const Distrain__V1__JobSpec *spec, char **argv, int argc, int accum)
{
  char **full = calloc((size_t)argc + 2, sizeof *full), flags[4096] = "";
  FUZZ_ASSERT(full, "out of memory");
  full[0] = "distrain-train";
  for (int i = 0; i < argc; i++) {
    full[i + 1] = argv[i];
    const size_t used = strlen(flags);
    snprintf(flags + used, sizeof flags - used, " %s", argv[i]);
  }
  dt_train_opts_t o;
  dt_train_opts_default(&o);
  FUZZ_ASSERT(dt_train_parse_args(argc + 1, full, &o) == 0,
              "distrain-train refuses the flags of a valid spec:%s", flags);
  char why[256];
  const Distrain__V1__ParallelSpec *par = spec->parallel;
  if (!(par->comm && strcmp(par->comm, "nccl") == 0 && !dt_comm_has_backend("nccl")))
    FUZZ_ASSERT(dt_train_opts_validate(&o, why, sizeof why) == 0,
                "distrain-train refuses the options of a valid spec (%s):%s", why, flags);
  const Distrain__V1__ModelSpec *m = spec->model;
  FUZZ_ASSERT(o.model.layers == m->layers && o.model.heads == m->heads &&
                  o.model.channels == m->channels && o.model.vocab == m->vocab &&
                  o.model.max_seq == m->max_seq,
              "the model changed on its way to the trainer:%s", flags);
  const Distrain__V1__TrainingSpec *t = spec->training;
  FUZZ_ASSERT(o.batch == t->micro_batch && o.seq == t->seq && o.grad_accum == accum &&
                  o.steps == t->steps,
              "the batch changed on its way to the trainer:%s", flags);
  const Distrain__V1__OptimizerSpec *opt = spec->optimizer;
  FUZZ_ASSERT(o.sched.lr == opt->lr && o.sched.min_lr_frac == opt->min_lr_frac &&
                  o.sched.warmup == opt->warmup,
              "the learning rate changed on its way to the trainer:%s", flags);
  FUZZ_ASSERT(o.zero_stage == par->zero_stage && o.recompute == par->activation_checkpointing &&
                  o.sequence_parallel == par->sequence_parallel,
              "the parallel settings changed on their way to the trainer:%s", flags);
  FUZZ_ASSERT(par->pp < 2 || !par->partition[0] ||
                  (o.pp_partition && strcmp(o.pp_partition, par->partition) == 0),
              "the pipeline partition changed:%s", flags);
  FUZZ_ASSERT(
      o.shuffle == spec->data->shuffle &&
          (t->val_every <= 0 || (o.val_every == t->val_every && o.val_batches == t->val_batches)),
      "the data settings changed on their way to the trainer:%s", flags);
  const Distrain__V1__CheckpointSpec *ck = spec->checkpoint;
  FUZZ_ASSERT(!ck->dir[0] || (o.ckpt_dir && strcmp(o.ckpt_dir, ck->dir) == 0 &&
                              o.save_every == ck->every && o.keep == ck->keep),
              "the checkpoint settings changed on their way to the trainer:%s", flags);
  FUZZ_ASSERT(
      strcmp(o.precision ? o.precision : "fp32", t->precision[0] ? t->precision : "fp32") == 0 &&
          strcmp(o.attention ? o.attention : "flash", t->attention[0] ? t->attention : "flash") ==
              0,
      "the precision or attention changed on their way to the trainer:%s", flags);
  dt_train_args_free(&o);
  free(full);
}

static void use(const Distrain__V1__JobSpec *spec)
{
  char err[4096], *yaml = NULL;
  int rc = dt_jobspec_to_yaml(spec, &yaml);
  FUZZ_ASSERT(rc == 0 && yaml, "an accepted spec does not emit as YAML (%d)", rc);
  Distrain__V1__JobSpec *back = fresh();
  rc = dt_jobspec_parse_yaml(yaml, strlen(yaml), "emitted", back, err, sizeof err);
  FUZZ_ASSERT(rc == 0, "emitted YAML does not parse back: %s\n%s", err, yaml);
  FUZZ_ASSERT(dt_jobspec_equal(spec, back), "emitted YAML parses back to another spec:\n%s", yaml);
  dt_jobspec_free(back);
  free(yaml);

  if (dt_jobspec_validate(spec, err, sizeof err) != 0) {
    FUZZ_ASSERT(err[0] != '\0', "validation failed without a reason");
    return;
  }
  dt_mesh_t mesh;
  FUZZ_ASSERT(dt_jobspec_mesh(spec, &mesh) == 0, "a valid spec has no mesh");
  const int accum = dt_jobspec_grad_accum(spec, mesh.dp);
  for (int resume = 0; resume < 2 && accum >= 1; resume++) {
    char **argv = NULL;
    int argc = 0;
    if (dt_jobspec_trainer_argv(spec, mesh.dp, resume, &argv, &argc) == 0) {
      FUZZ_ASSERT(argv && argc >= 0 && argv[argc] == NULL, "argv not NULL-terminated");
      trainer_accepts(spec, argv, argc, accum);
      dt_argv_free(argv);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
  char err[1024];
  Distrain__V1__JobSpec *spec = fresh();
  if (size >= 4 && memcmp(data, "#set", 4) == 0) {
    char *text = strndup((const char *)data, size); /* assignments are C strings */
    FUZZ_ASSERT(text, "out of memory");
    apply_sets(spec, text);
    free(text);
    use(spec);
  } else {
    Distrain__V1__JobSpec *orig = fresh();
    if (dt_jobspec_parse_yaml((const char *)data, size, "fuzz.yaml", spec, err, sizeof err) != 0) {
      FUZZ_ASSERT(err[0] != '\0', "a document was refused without a reason");
      FUZZ_ASSERT(dt_jobspec_equal(spec, orig), "a refused document changed the spec (%s)", err);
    } else {
      use(spec);
    }
    dt_jobspec_free(orig);
  }
  dt_jobspec_free(spec);
  return 0;
}
