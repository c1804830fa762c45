/* args.c — see args.h. Every malformed flag value is an error naming the flag; nothing is
 * silently defaulted. */
#include "args.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_util.h"
#include "jobspec.h"
#include "schedule.h"

static void usage(FILE *out)
{
  fprintf(
      out,
      "usage: distrain-train --train GLOB [options]\n"
      "\n"
      "model (default: the demo's byte-level L4 H4 C256 V256 maxT256):\n"
      "  --init llmc:PATH | hf:DIR | ckpt:DIR | seed:N\n"
      "                              start from llm.c fp32 weights, Hugging Face's GPT-2\n"
      "                              (config.json + model.safetensors), a distrain checkpoint's\n"
      "                              weights (its newest step, or a step dir; the optimizer, step\n"
      "                              and data start afresh: fine-tuning), or GPT-2 init from a\n"
      "                              seed\n"
      "  --seed N                    init and shuffle seed (default 1337)\n"
      "  --layers N --heads N --channels N --vocab N --max-seq N\n"
      "data:\n"
      "  --train GLOB --val GLOB     llm.c token shards (file or glob; --steps 0 needs no "
      "--train)\n"
      "  --train W:GLOB,W:GLOB,...   a weighted blend of sources (Megatron-LM's --data-path "
      "weights)\n"
      "  --val-sets NAME=GLOB,...    validation sets, each validated as --val is and its loss\n"
      "                              reported alone under its name (with --val-every)\n"
      "  --shuffle                   seeded shuffling of shards and windows (default: sequential)\n"
      "  --val-every N --val-batches N (default 20; global batches: batch x dp x grad-accum\n"
      "                              sequences each)\n"
      "  --eval FILE                 a multiple-choice eval (HellaSwag; llm.c's eval format, from\n"
      "                              distrain-prep --hellaswag): accuracy before training, after\n"
      "                              the last step and every --eval-every N steps\n"
      "  --eval-out FILE             each evaluation's per-example losses as JSON lines\n"
      "batch:\n"
      "  --batch B --seq T --grad-accum K --steps N (total; sets the schedule)\n"
      "  --stop-at S                 stop after step S with a checkpoint (resume later)\n"
      "  --skip-steps S,S:N,...      take these steps (S:N: the N from S) without an update\n"
      "                              (their batches are consumed; set by the coordinator after\n"
      "                              a rollback)\n"
      "  --spike-factor F            a step whose loss is over F times the average of the recent\n"
      "                              steps' (about 50; kept in checkpoints) stops before its\n"
      "                              update, as a NaN/Inf one does: under distrainctl the job\n"
      "                              rolls back and skips that step's batch (default 0: off)\n"
      "  --grad-spike-factor F       the same of the global gradient norm (before clipping)\n"
      "  --spike-skip N              and the next N - 1 steps' too, as PaLM skipped a few\n"
      "                              hundred batches around a spike (default 1)\n"
      "  --bad-step rollback|skip    a non-finite or spiking step: stop for a rollback to the\n"
      "                              last checkpoint (default), or take it (and its\n"
      "                              --spike-skip window) without an update where it is and\n"
      "                              go on; a second right after rolls back\n"
      "optimizer (AdamW):\n"
      "  --lr X --warmup N --schedule constant|cosine|linear|wsd --min-lr-frac X\n"
      "  --decay-frac X              wsd: the share of the steps after warmup spent decaying\n"
      "                              (default 0.2)\n"
      "  --weight-decay X --beta1 X --beta2 X --eps X --grad-clip X (0: off)\n"
      "checkpoints:\n"
      "  --ckpt-dir DIR --save-every N --keep N --resume[=PATH] --export-llmc PATH\n"
      "  --save-every-s S            also save once S seconds have passed since the last save\n"
      "                              began (time-based; --save-every N: by steps)\n"
      "  --keep-every N              also keep every checkpoint of a step N divides, whatever\n"
      "                              --keep says (N a multiple of --save-every)\n"
      "  --last-save-wait S          the last step's save found a disk full: wait up to S s for\n"
      "                              room and write it again before failing (default 600; 0:\n"
      "                              fail at once)\n"
      "  --ckpt-sync                 write each checkpoint in the step (default: the step pauses\n"
      "                              only to copy its shard; a thread writes and commits it)\n"
      "output:\n"
      "  --metrics FILE (JSON per step) --threads N --quiet\n"
      "  --sample N --sample-temp X  rank 0 generates N tokens after training (temperature\n"
      "                              default 0.8)\n"
      "  --sample-top-k K --sample-top-p P  drawn among the K most likely tokens only, and of\n"
      "                              those the fewest holding probability P (nucleus; default\n"
      "                              off: 0 and 1)\n"
      "  --sample-every S            also every S steps during training (its own seed: the\n"
      "                              run's data and results stay as they are)\n"
      "  --sample-no-cache           run each token's whole window (default: a key/value\n"
      "                              cache, one row a token, until the window slides)\n"
      "  --peak-tflops T             a device's peak TFLOP/s, for the MFU in the step lines\n"
      "                              (default: a known GPU's dense bf16 peak under bf16)\n"
      "  --vocab-file vocab.json     GPT-2 BPE vocabulary the sample's tokens are printed with\n"
      "                              (default: bytes for a 256-token vocabulary, else ids)\n"
      "  --prompt TEXT               the sample's prompt (default: the first sequence of --val,\n"
      "                              else --train): GPT-2's BPE tokens (--vocab-file and\n"
      "                              --merge-file), or its bytes for a 256-token vocabulary\n"
      "  --merge-file merges.txt     GPT-2 BPE merges, to encode --prompt with\n"
      "  --profile S[:N]             time every kernel and communication call of steps S..S+N-1\n"
      "                              (N default 1) and log where the step went (default:\n"
      "                              DISTRAIN_PROFILE, else off)\n"
      "  --profile-trace FILE        also write those steps' calls as a Chrome trace (%%r:\n"
      "                              the rank; default: DISTRAIN_PROFILE_TRACE)\n"
      "device:\n"
      "  --device cpu|cuda|auto      where to train (default auto: the GPU that LOCAL_RANK picks\n"
      "                              when a CUDA GPU is present, else the CPU)\n"
      "  --precision fp32|bf16       bf16: linear layers and flash attention's products as bf16\n"
      "                              GEMMs accumulating in fp32, the rest and the master weights\n"
      "                              fp32 (default fp32)\n"
      "  --attention flash|materialized  flash: keep each query row's log-sum-exp and recompute\n"
      "                              the probabilities in backward; materialized: keep the\n"
      "                              (T, T) probabilities of every layer (default flash)\n"
      "  --comm auto|cpu|nccl        collectives between GPU trainers: nccl on device memory, or\n"
      "                              cpu staged through host memory (default auto: nccl when\n"
      "                              every rank has a GPU of its own and this build has NCCL)\n"
      "parallelism (one process per rank; environment as torchrun sets it):\n"
      "  WORLD_SIZE, RANK, and DISTRAIN_COORDINATOR (set by the agent) or DISTRAIN_KV_DIR\n"
      "  (a shared directory) for rendezvous; --tp N splits layers over N tensor-parallel\n"
      "  ranks (neighbours in rank order), --pp N the layers into N pipeline stages\n"
      "  (--pp-schedule 1f1b|gpipe|interleaved, --pp-virtual V: model chunks per stage with\n"
      "  interleaved, default 2; --pp-partition 3,1: layers per (virtual) stage, default by\n"
      "  cost; --grad-accum micro-batches per step), --cp N each sequence into N chunks\n"
      "  (context parallel), the rest is data parallel (dp = WORLD_SIZE / (tp x pp x cp));\n"
      "  --zero-stage 0..3 shards optimizer state, gradients and parameters over dp x cp;\n"
      "  --recompute: activation checkpointing (keep each\n"
      "  layer's output, recompute the rest in the backward pass); --sp: sequence parallelism\n"
      "  (LayerNorm and residual rows split over the tp group)\n");
}

enum {
  OPT_INIT = 256,
  OPT_SEED,
  OPT_LAYERS,
  OPT_HEADS,
  OPT_CHANNELS,
  OPT_VOCAB,
  OPT_MAXSEQ,
  OPT_TRAIN,
  OPT_VAL,
  OPT_VAL_SETS,
  OPT_SHUFFLE,
  OPT_VAL_EVERY,
  OPT_VAL_BATCHES,
  OPT_EVAL,
  OPT_EVAL_EVERY,
  OPT_EVAL_OUT,
  OPT_BATCH,
  OPT_SEQ,
  OPT_ACCUM,
  OPT_STEPS,
  OPT_STOP_AT,
  OPT_SKIP_STEPS,
  OPT_SPIKE_FACTOR,
  OPT_SPIKE_SKIP,
  OPT_GRAD_SPIKE_FACTOR,
  OPT_BAD_STEP,
  OPT_LR,
  OPT_WARMUP,
  OPT_SCHEDULE,
  OPT_MINLR,
  OPT_DECAY_FRAC,
  OPT_WD,
  OPT_BETA1,
  OPT_BETA2,
  OPT_EPS,
  OPT_CLIP,
  OPT_CKPT_DIR,
  OPT_SAVE_EVERY,
  OPT_SAVE_EVERY_S,
  OPT_KEEP,
  OPT_KEEP_EVERY,
  OPT_LAST_SAVE_WAIT,
  OPT_RESUME,
  OPT_CKPT_SYNC,
  OPT_EXPORT,
  OPT_METRICS,
  OPT_PEAK_TFLOPS,
  OPT_SAMPLE,
  OPT_SAMPLE_TEMP,
  OPT_SAMPLE_TOP_K,
  OPT_SAMPLE_NO_CACHE,
  OPT_SAMPLE_EVERY,
  OPT_SAMPLE_TOP_P,
  OPT_VOCAB_FILE,
  OPT_MERGE_FILE,
  OPT_PROMPT,
  OPT_THREADS,
  OPT_ZERO,
  OPT_TP,
  OPT_PP,
  OPT_CP,
  OPT_PP_SCHEDULE,
  OPT_RECOMPUTE,
  OPT_SP,
  OPT_PP_PARTITION,
  OPT_PP_VIRTUAL,
  OPT_QUIET,
  OPT_PROFILE,
  OPT_PROFILE_TRACE,
  OPT_DEVICE,
  OPT_COMM,
  OPT_PRECISION,
  OPT_ATTENTION,
  OPT_HELP,
};

static const struct option g_opts[] = {
    {"init", required_argument, 0, OPT_INIT},
    {"seed", required_argument, 0, OPT_SEED},
    {"layers", required_argument, 0, OPT_LAYERS},
    {"heads", required_argument, 0, OPT_HEADS},
    {"channels", required_argument, 0, OPT_CHANNELS},
    {"vocab", required_argument, 0, OPT_VOCAB},
    {"max-seq", required_argument, 0, OPT_MAXSEQ},
    {"train", required_argument, 0, OPT_TRAIN},
    {"val", required_argument, 0, OPT_VAL},
    {"val-sets", required_argument, 0, OPT_VAL_SETS},
    {"shuffle", no_argument, 0, OPT_SHUFFLE},
    {"val-every", required_argument, 0, OPT_VAL_EVERY},
    {"val-batches", required_argument, 0, OPT_VAL_BATCHES},
    {"eval", required_argument, 0, OPT_EVAL},
    {"peak-tflops", required_argument, 0, OPT_PEAK_TFLOPS},
    {"eval-every", required_argument, 0, OPT_EVAL_EVERY},
    {"eval-out", required_argument, 0, OPT_EVAL_OUT},
    {"batch", required_argument, 0, OPT_BATCH},
    {"seq", required_argument, 0, OPT_SEQ},
    {"grad-accum", required_argument, 0, OPT_ACCUM},
    {"steps", required_argument, 0, OPT_STEPS},
    {"stop-at", required_argument, 0, OPT_STOP_AT},
    {"skip-steps", required_argument, 0, OPT_SKIP_STEPS},
    {"spike-factor", required_argument, 0, OPT_SPIKE_FACTOR},
    {"spike-skip", required_argument, 0, OPT_SPIKE_SKIP},
    {"grad-spike-factor", required_argument, 0, OPT_GRAD_SPIKE_FACTOR},
    {"bad-step", required_argument, 0, OPT_BAD_STEP},
    {"lr", required_argument, 0, OPT_LR},
    {"warmup", required_argument, 0, OPT_WARMUP},
    {"schedule", required_argument, 0, OPT_SCHEDULE},
    {"min-lr-frac", required_argument, 0, OPT_MINLR},
    {"decay-frac", required_argument, 0, OPT_DECAY_FRAC},
    {"weight-decay", required_argument, 0, OPT_WD},
    {"beta1", required_argument, 0, OPT_BETA1},
    {"beta2", required_argument, 0, OPT_BETA2},
    {"eps", required_argument, 0, OPT_EPS},
    {"grad-clip", required_argument, 0, OPT_CLIP},
    {"ckpt-dir", required_argument, 0, OPT_CKPT_DIR},
    {"save-every", required_argument, 0, OPT_SAVE_EVERY},
    {"save-every-s", required_argument, 0, OPT_SAVE_EVERY_S},
    {"keep", required_argument, 0, OPT_KEEP},
    {"keep-every", required_argument, 0, OPT_KEEP_EVERY},
    {"last-save-wait", required_argument, 0, OPT_LAST_SAVE_WAIT},
    {"resume", optional_argument, 0, OPT_RESUME},
    {"ckpt-sync", no_argument, 0, OPT_CKPT_SYNC},
    {"export-llmc", required_argument, 0, OPT_EXPORT},
    {"metrics", required_argument, 0, OPT_METRICS},
    {"sample", required_argument, 0, OPT_SAMPLE},
    {"sample-temp", required_argument, 0, OPT_SAMPLE_TEMP},
    {"sample-top-k", required_argument, 0, OPT_SAMPLE_TOP_K},
    {"sample-no-cache", no_argument, 0, OPT_SAMPLE_NO_CACHE},
    {"sample-every", required_argument, 0, OPT_SAMPLE_EVERY},
    {"sample-top-p", required_argument, 0, OPT_SAMPLE_TOP_P},
    {"vocab-file", required_argument, 0, OPT_VOCAB_FILE},
    {"merge-file", required_argument, 0, OPT_MERGE_FILE},
    {"prompt", required_argument, 0, OPT_PROMPT},
    {"threads", required_argument, 0, OPT_THREADS},
    {"zero-stage", required_argument, 0, OPT_ZERO},
    {"device", required_argument, 0, OPT_DEVICE},
    {"comm", required_argument, 0, OPT_COMM},
    {"precision", required_argument, 0, OPT_PRECISION},
    {"attention", required_argument, 0, OPT_ATTENTION},
    {"tp", required_argument, 0, OPT_TP},
    {"pp", required_argument, 0, OPT_PP},
    {"cp", required_argument, 0, OPT_CP},
    {"pp-schedule", required_argument, 0, OPT_PP_SCHEDULE},
    {"recompute", no_argument, 0, OPT_RECOMPUTE},
    {"sp", no_argument, 0, OPT_SP},
    {"pp-partition", required_argument, 0, OPT_PP_PARTITION},
    {"pp-virtual", required_argument, 0, OPT_PP_VIRTUAL},
    {"quiet", no_argument, 0, OPT_QUIET},
    {"profile", required_argument, 0, OPT_PROFILE},
    {"profile-trace", required_argument, 0, OPT_PROFILE_TRACE},
    {"help", no_argument, 0, OPT_HELP},
    {0, 0, 0, 0},
};

static const char *opt_name(int code)
{
  for (const struct option *o = g_opts; o->name; o++)
    if (o->val == code)
      return o->name;
  return "?";
}

static int parse_int(int code, const char *s, int *out)
{
  int64_t v;
  if (dt_parse_i64(s, &v) != 0 || v < -2147483647 || v > 2147483647) {
    fprintf(stderr, "distrain-train: --%s: expected an integer, got '%s'\n", opt_name(code), s);
    return DT_EINVAL;
  }
  *out = (int)v;
  return 0;
}

static int parse_float(int code, const char *s, double *out)
{
  if (dt_parse_f64(s, out) != 0) {
    fprintf(stderr, "distrain-train: --%s: expected a number, got '%s'\n", opt_name(code), s);
    return DT_EINVAL;
  }
  return 0;
}

static int cmp_i64(const void *a, const void *b)
{
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* "10,57,70:5": positive step numbers and runs of them (S:N, dt_parse_step_range), kept
 * ascending and each once in an array as long as the list needs (a rollback after each
 * non-finite step adds one, a loss spike's elastic.spike_skip, within the job's max_restarts,
 * which has no bound), at most DT_SKIP_STEPS_MAX steps. Every comma-separated token must be one
 * (an empty one is an error). */
static int parse_skip_steps(const char *s, dt_train_opts_t *o)
{
  int64_t *steps = NULL;
  size_t n = 0, cap = 0;
  char why[96] = "expected step numbers >= 1 or S:N (N steps from S), comma-separated";
  for (const char *p = s;;) {
    const char *comma = strchr(p, ',');
    const size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char tok[32];
    int first = 0, count = 0;
    if (len < sizeof tok) {
      memcpy(tok, p, len);
      tok[len] = '\0';
    }
    if (len == 0 || len >= sizeof tok || dt_parse_step_range(tok, &first, &count) != 0)
      goto bad;
    if (n + (size_t)count > DT_SKIP_STEPS_MAX) {
      snprintf(why, sizeof why, "at most %d steps", DT_SKIP_STEPS_MAX);
      goto bad;
    }
    if (n + (size_t)count > cap) {
      cap = DT_MAX(2 * cap, n + (size_t)count);
      int64_t *grown = realloc(steps, cap * sizeof *steps);
      if (!grown) {
        free(steps);
        return DT_ENOMEM;
      }
      steps = grown;
    }
    for (int i = 0; i < count; i++)
      steps[n++] = (int64_t)first + i;
    if (!comma)
      break;
    p = comma + 1;
  }
  qsort(steps, n, sizeof *steps, cmp_i64);
  size_t kept = 0;
  for (size_t i = 0; i < n; i++)
    if (kept == 0 || steps[i] != steps[kept - 1])
      steps[kept++] = steps[i];
  dt_train_args_free(o); /* an earlier --skip-steps */
  o->skip_steps = steps;
  o->n_skip_steps = (int)kept;
  return 0;
bad:
  fprintf(stderr, "distrain-train: --skip-steps: %s, got '%s'\n", why, s);
  free(steps);
  return DT_EINVAL;
}

void dt_train_args_free(dt_train_opts_t *o)
{
  free((void *)o->skip_steps);
  o->skip_steps = NULL;
  o->n_skip_steps = 0;
}

/* --profile or DISTRAIN_PROFILE (from names which): "S" or "S:N". */
static int parse_profile(const char *from, const char *s, dt_train_opts_t *o)
{
  if (dt_parse_step_range(s, &o->profile_from, &o->profile_steps) != 0) {
    fprintf(stderr,
            "distrain-train: %s: expected S or S:N (profile N >= 1 steps from step S >= 1), "
            "got '%s'\n",
            from, s);
    return DT_EINVAL;
  }
  return 0;
}

static int parse_init(const char *s, dt_train_opts_t *o)
{
  static const char *const kinds[] = {"llmc:", "hf:", "ckpt:"};
  const char **dst[] = {&o->init_llmc, &o->init_hf, &o->init_ckpt};
  for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
    const size_t len = strlen(kinds[k]);
    if (strncmp(s, kinds[k], len) == 0 && s[len]) {
      o->init_llmc = o->init_hf = o->init_ckpt = NULL; /* the last --init counts */
      *dst[k] = s + len;
      return 0;
    }
  }
  int64_t seed;
  if (strncmp(s, "seed:", 5) == 0 && dt_parse_i64(s + 5, &seed) == 0 && seed >= 0) {
    o->seed = (uint64_t)seed;
    return 0;
  }
  fprintf(stderr,
          "distrain-train: --init: expected llmc:PATH, hf:DIR, ckpt:DIR or seed:N, got '%s'\n", s);
  return DT_EINVAL;
}

int dt_train_parse_args(int argc, char **argv, dt_train_opts_t *o)
{
  int c, iv = 0;
  double dv = 0.0;
  opterr = 0;
  optind = 0; /* glibc: a full re-initialisation, so that a process may parse more than once */
  while ((c = getopt_long(argc, argv, "h", g_opts, NULL)) != -1) {
    int rc = 0;
    switch (c) {
    case OPT_INIT:
      rc = parse_init(optarg, o);
      break;
    case OPT_SEED:
      rc = parse_int(c, optarg, &iv);
      o->seed = (uint64_t)iv;
      break;
#define MODEL_FLAG(code, field, bit)                                                               \
  case code:                                                                                       \
    rc = parse_int(c, optarg, &o->model.field);                                                    \
    o->model_set_mask |= bit;                                                                      \
    break;
      MODEL_FLAG(OPT_LAYERS, layers, DT_MODEL_LAYERS)
      MODEL_FLAG(OPT_HEADS, heads, DT_MODEL_HEADS)
      MODEL_FLAG(OPT_CHANNELS, channels, DT_MODEL_CHANNELS)
      MODEL_FLAG(OPT_VOCAB, vocab, DT_MODEL_VOCAB)
      MODEL_FLAG(OPT_MAXSEQ, max_seq, DT_MODEL_MAXSEQ)
#undef MODEL_FLAG
    case OPT_TRAIN:
      o->train_pattern = optarg;
      break;
    case OPT_VAL:
      o->val_pattern = optarg;
      break;
    case OPT_VAL_SETS:
      o->val_sets = optarg;
      break;
    case OPT_SHUFFLE:
      o->shuffle = 1;
      break;
    case OPT_VAL_EVERY:
      rc = parse_int(c, optarg, &o->val_every);
      break;
    case OPT_VAL_BATCHES:
      rc = parse_int(c, optarg, &o->val_batches);
      break;
    case OPT_EVAL:
      o->eval_path = optarg;
      break;
    case OPT_EVAL_EVERY:
      rc = parse_int(c, optarg, &o->eval_every);
      break;
    case OPT_EVAL_OUT:
      o->eval_out = optarg;
      break;
    case OPT_BATCH:
      rc = parse_int(c, optarg, &o->batch);
      break;
    case OPT_SEQ:
      rc = parse_int(c, optarg, &o->seq);
      break;
    case OPT_ACCUM:
      rc = parse_int(c, optarg, &o->grad_accum);
      break;
    case OPT_STEPS:
      rc = parse_int(c, optarg, &o->steps);
      break;
    case OPT_STOP_AT:
      rc = parse_int(c, optarg, &o->stop_at);
      break;
    case OPT_SKIP_STEPS:
      rc = parse_skip_steps(optarg, o);
      break;
    case OPT_LR:
      rc = parse_float(c, optarg, &o->sched.lr);
      break;
    case OPT_WARMUP:
      rc = parse_int(c, optarg, &o->sched.warmup);
      break;
    case OPT_SCHEDULE:
      if (dt_lr_schedule_parse(optarg, &o->sched.schedule) != 0) {
        fprintf(stderr,
                "distrain-train: --schedule: expected constant, cosine, linear or wsd, got "
                "'%s'\n",
                optarg);
        rc = DT_EINVAL;
      }
      break;
    case OPT_DECAY_FRAC:
      rc = parse_float(c, optarg, &o->sched.decay_frac);
      break;
    case OPT_PEAK_TFLOPS:
      rc = parse_float(c, optarg, &o->peak_tflops);
      break;
    case OPT_SPIKE_FACTOR:
      rc = parse_float(c, optarg, &o->spike_factor);
      break;
    case OPT_SPIKE_SKIP:
      rc = parse_int(c, optarg, &o->spike_skip);
      break;
    case OPT_GRAD_SPIKE_FACTOR:
      rc = parse_float(c, optarg, &o->grad_spike_factor);
      break;
    case OPT_BAD_STEP:
      if (strcmp(optarg, "rollback") != 0 && strcmp(optarg, "skip") != 0) {
        fprintf(stderr, "distrain-train: --bad-step: expected rollback or skip, got '%s'\n",
                optarg);
        rc = DT_EINVAL;
      }
      o->bad_step_skip = strcmp(optarg, "skip") == 0;
      break;
    case OPT_MINLR:
      rc = parse_float(c, optarg, &o->sched.min_lr_frac);
      break;
#define FLOAT_FLAG(code, field)                                                                    \
  case code:                                                                                       \
    rc = parse_float(c, optarg, &dv);                                                              \
    o->field = (float)dv;                                                                          \
    break;
      FLOAT_FLAG(OPT_WD, weight_decay)
      FLOAT_FLAG(OPT_BETA1, beta1)
      FLOAT_FLAG(OPT_BETA2, beta2)
      FLOAT_FLAG(OPT_EPS, eps)
      FLOAT_FLAG(OPT_CLIP, grad_clip)
      FLOAT_FLAG(OPT_SAMPLE_TEMP, sample_temp)
      FLOAT_FLAG(OPT_SAMPLE_TOP_P, sample_top_p)
#undef FLOAT_FLAG
    case OPT_CKPT_DIR:
      o->ckpt_dir = optarg;
      break;
    case OPT_SAVE_EVERY:
      rc = parse_int(c, optarg, &o->save_every);
      break;
    case OPT_SAVE_EVERY_S:
      rc = parse_int(c, optarg, &o->save_every_s);
      break;
    case OPT_KEEP:
      rc = parse_int(c, optarg, &o->keep);
      break;
    case OPT_KEEP_EVERY:
      rc = parse_int(c, optarg, &o->keep_every);
      break;
    case OPT_LAST_SAVE_WAIT:
      rc = parse_int(c, optarg, &o->last_save_wait);
      break;
    case OPT_RESUME:
      o->resume = 1;
      o->resume_path = optarg;
      break;
    case OPT_EXPORT:
      o->export_llmc = optarg;
      break;
    case OPT_METRICS:
      o->metrics_path = optarg;
      break;
    case OPT_SAMPLE:
      rc = parse_int(c, optarg, &o->sample_tokens);
      break;
    case OPT_SAMPLE_TOP_K:
      rc = parse_int(c, optarg, &o->sample_top_k);
      break;
    case OPT_SAMPLE_EVERY:
      rc = parse_int(c, optarg, &o->sample_every);
      break;
    case OPT_VOCAB_FILE:
      o->vocab_file = optarg;
      break;
    case OPT_MERGE_FILE:
      o->merge_file = optarg;
      break;
    case OPT_PROMPT:
      o->prompt = optarg;
      break;
    case OPT_ZERO:
      rc = parse_int(c, optarg, &o->zero_stage);
      break;
    case OPT_TP:
    case OPT_PP:
    case OPT_CP:
    case OPT_PP_VIRTUAL: {
      int *v = c == OPT_TP ? &o->tp : c == OPT_PP ? &o->pp : c == OPT_CP ? &o->cp : &o->pp_virtual;
      rc = parse_int(c, optarg, v);
      if (rc == 0 && *v < 1) {
        fprintf(stderr, "distrain-train: --%s must be >= 1, got %d\n", opt_name(c), *v);
        rc = DT_EINVAL;
      }
      break;
    }
    case OPT_PP_SCHEDULE:
      if (dt_pipe_parse(optarg, &o->pp_schedule) != 0) {
        fprintf(stderr,
                "distrain-train: --pp-schedule: expected 1f1b, gpipe or interleaved, got '%s'\n",
                optarg);
        rc = DT_EINVAL;
      }
      break;
    case OPT_THREADS:
      rc = parse_int(c, optarg, &o->threads);
      break;
    case OPT_QUIET:
      o->quiet = 1;
      break;
    case OPT_PROFILE:
      rc = parse_profile("--profile", optarg, o);
      break;
    case OPT_PROFILE_TRACE:
      o->profile_trace = optarg;
      break;
    case OPT_DEVICE:
      o->device = optarg;
      break;
    case OPT_COMM:
      o->comm = optarg;
      break;
    case OPT_PRECISION:
      o->precision = optarg;
      break;
    case OPT_ATTENTION:
      o->attention = optarg;
      break;
    case OPT_RECOMPUTE:
      o->recompute = 1;
      break;
    case OPT_CKPT_SYNC:
      o->ckpt_sync = 1;
      break;
    case OPT_SP:
      o->sequence_parallel = 1;
      break;
    case OPT_SAMPLE_NO_CACHE:
      o->sample_no_cache = 1;
      break;
    case OPT_PP_PARTITION:
      o->pp_partition = optarg;
      break;
    case OPT_HELP:
    case 'h':
      usage(stdout);
      return 1;
    default:
      fprintf(stderr, "distrain-train: unknown or incomplete option '%s'\n", argv[optind - 1]);
      usage(stderr);
      return DT_EINVAL;
    }
    if (rc != 0)
      return rc;
  }
  if (optind < argc) {
    fprintf(stderr, "distrain-train: unexpected argument '%s'\n", argv[optind]);
    return DT_EINVAL;
  }
  /* The variable reaches the trainers an agent starts (every DISTRAIN_* does); the flag wins. */
  const char *env = getenv("DISTRAIN_PROFILE"), *trace = getenv("DISTRAIN_PROFILE_TRACE");
  if (!o->profile_from && env && *env && parse_profile("DISTRAIN_PROFILE", env, o) != 0)
    return DT_EINVAL;
  if (!o->profile_trace && trace && *trace)
    o->profile_trace = trace;
  if (o->profile_trace && !o->profile_from) {
    fprintf(stderr, "distrain-train: --profile-trace needs --profile (or DISTRAIN_PROFILE): "
                    "which steps to trace\n");
    return DT_EINVAL;
  }
  return 0;
}
