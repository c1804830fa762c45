/* ctl_plan.c — `distrainctl plan`: the memory/time planner (common/planner.h) on the command
 * line. Reads a model (preset, explicit dimensions or a job spec), a batch and a cluster,
 * evaluates every valid layout (or the one --layout names) and prints a table, JSON, and with
 * --emit-spec the recommended layout as job-spec YAML. Exit codes: 0, 1 (nothing fits), 2
 * (usage errors). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"
#include "dt_error.h"
#include "dt_util.h"
#include "jobspec.h"
#include "planner.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

typedef struct {
  dt_plan_model_t model;
  dt_plan_train_t tr;
  dt_plan_cluster_t cl;
  const char *model_name; /* preset or "custom" */
  int have_model, have_layout, top, json, emit, micro_from_job;
  dt_plan_layout_t layout;
} plan_args_t;

static void plan_usage(FILE *out)
{
  fprintf(
      out,
      "usage: distrainctl plan (--model PRESET | --layers L --hidden H --heads A [--kv-heads K]\n"
      "                         [--ffn F] [--vocab V] [--max-seq S] [--arch gpt2|llama]\n"
      "                         | --job JOB.yaml)\n"
      "                        --seq S --global-batch B --gpus N [--gpus-per-node G]\n"
      "                        [--gpu-mem-gib M] [--peak-tflops T] [--mfu F] [--intra-gbps X]\n"
      "                        [--inter-gbps Y] [--latency-us U] [--reserve-gib R]\n"
      "                        [--precision bf16|fp32|mixed16]\n"
      "                        [--attention flash|materialized] [--top K] [--json]\n"
      "                        [--emit-spec]\n"
      "                        [--layout dp=D,tp=T,pp=P,cp=C,zero=Z,micro=M,ckpt=0|1]\n"
      "  presets: %s\n"
      "  defaults: an H100 node: 8 GPUs per node, 80 GiB, 989 TFLOP/s (bf16 dense), MFU 0.4,\n"
      "  NVLink 450 GB/s, InfiniBand 50 GB/s per GPU, 10 us per collective, 1 GiB of each\n"
      "  GPU left for what is not counted (the CUDA context, NCCL's buffers); bf16, flash\n"
      "  attention (or the job spec's); top 10.\n"
      "  --precision: bf16 and fp32 are distrain-train's (bf16: fp32 master weights, gradients\n"
      "  and Adam state plus a bf16 weight copy, 4+2+4+8 bytes/param); mixed16 is the textbook\n"
      "  16-bit trainer (2+2+12 bytes/param, 16-bit activations), to compare with others.\n"
      "  --layout evaluates that one layout (gpus default to dp x tp x pp x cp).\n",
      dt_plan_preset_names());
}

static int bad(const char *fmt, const char *a, const char *b)
{
  fprintf(stderr, "distrainctl plan: ");
  fprintf(stderr, fmt, a, b);
  fputc('\n', stderr);
  return DT_EINVAL;
}

static int parse_int(const char *opt, const char *s, int min, int *out)
{
  int64_t v;
  if (dt_parse_i64(s, &v) != 0 || v < min || v > (1 << 30)) {
    fprintf(stderr, "distrainctl plan: %s: expected an integer from %d to %d, got '%s'\n", opt, min,
            1 << 30, s);
    return DT_EINVAL;
  }
  *out = (int)v;
  return 0;
}

static int parse_double(const char *opt, const char *s, int zero_ok, double *out)
{
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(zero_ok ? v >= 0 : v > 0) || !isfinite(v))
    return bad(zero_ok ? "%s: expected a number >= 0, got '%s'"
                       : "%s: expected a positive number, got '%s'",
               opt, s);
  *out = v;
  return 0;
}

static int parse_pos_double(const char *opt, const char *s, double *out)
{
  return parse_double(opt, s, 0, out);
}

/* "dp=2,tp=1,pp=1,cp=1,zero=3,micro=2,ckpt=0": every key optional (dp, tp, pp, cp 1; zero 0;
 * micro: the whole per-rank batch; ckpt 0). */
static int parse_layout(const char *text, dt_plan_layout_t *l)
{
  *l = (dt_plan_layout_t){.dp = 1, .tp = 1, .pp = 1, .cp = 1};
  char buf[256];
  if (strlen(text) >= sizeof buf)
    return bad("--layout '%s': too long%s", text, "");
  strcpy(buf, text);
  for (char *save, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
    static const char *keys[] = {"dp", "tp", "pp", "cp", "zero", "micro", "ckpt"};
    int *fields[] = {&l->dp, &l->tp, &l->pp, &l->cp, &l->zero, &l->micro, &l->ckpt};
    char *eq = strchr(kv, '=');
    size_t k = 0;
    if (eq)
      for (*eq = 0; k < DT_ARRAY_SIZE(keys) && strcmp(kv, keys[k]) != 0; k++)
        ;
    int64_t v;
    if (!eq || k == DT_ARRAY_SIZE(keys) || dt_parse_i64(eq + 1, &v) != 0 || v < 0 || v > 1 << 20)
      return bad("--layout '%s': expected dp=D,tp=T,pp=P,cp=C,zero=Z,micro=M,ckpt=0|1 (%s)", text,
                 "non-negative integers");
    *fields[k] = (int)v;
  }
  return 0;
}

/* The model and batch of a job spec (GPT-2 shape; a micro_batch there fixes the layout's). */
static int load_job(const char *path, plan_args_t *a)
{
  Distrain__V1__JobSpec *spec;
  char err[1024];
  if (dt_jobspec_new_default(&spec) != 0)
    return DT_ENOMEM;
  int rc = dt_jobspec_parse_file(path, spec, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "distrainctl plan: %s\n", err);
  } else {
    const Distrain__V1__ModelSpec *m = spec->model;
    a->model = (dt_plan_model_t){DT_PLAN_GPT2, m->layers, m->channels, m->heads, 0, 0,
                                 m->vocab,     m->max_seq};
    a->tr.seq = spec->training->seq;
    a->tr.global_batch = spec->training->batch;
    const char *att = spec->training->attention, *prec = spec->training->precision;
    a->tr.materialized = att && strcmp(att, "materialized") == 0;
    a->tr.precision = prec && strcmp(prec, "bf16") == 0 ? DT_PLAN_BF16 : DT_PLAN_FP32;
    a->model_name = path;
    a->have_model = 1;
  }
  dt_jobspec_free(spec);
  return rc;
}

static int parse_plan(int argc, char **argv, plan_args_t *a)
{
  enum {
    O_MODEL = 256,
    O_LAYERS,
    O_HIDDEN,
    O_HEADS,
    O_KV,
    O_FFN,
    O_VOCAB,
    O_MAXSEQ,
    O_ARCH,
    O_SEQ,
    O_BATCH,
    O_GPUS,
    O_GPN,
    O_MEM,
    O_PEAK,
    O_MFU,
    O_INTRA,
    O_INTER,
    O_PREC,
    O_ATTN,
    O_TOP,
    O_JSON,
    O_EMIT,
    O_JOB,
    O_LAYOUT,
    O_LAT,
    O_RESERVE,
    O_HELP
  };
  static const struct option opts[] = {{"model", required_argument, 0, O_MODEL},
                                       {"layers", required_argument, 0, O_LAYERS},
                                       {"hidden", required_argument, 0, O_HIDDEN},
                                       {"heads", required_argument, 0, O_HEADS},
                                       {"kv-heads", required_argument, 0, O_KV},
                                       {"ffn", required_argument, 0, O_FFN},
                                       {"vocab", required_argument, 0, O_VOCAB},
                                       {"max-seq", required_argument, 0, O_MAXSEQ},
                                       {"arch", required_argument, 0, O_ARCH},
                                       {"seq", required_argument, 0, O_SEQ},
                                       {"global-batch", required_argument, 0, O_BATCH},
                                       {"gpus", required_argument, 0, O_GPUS},
                                       {"gpus-per-node", required_argument, 0, O_GPN},
                                       {"gpu-mem-gib", required_argument, 0, O_MEM},
                                       {"peak-tflops", required_argument, 0, O_PEAK},
                                       {"mfu", required_argument, 0, O_MFU},
                                       {"intra-gbps", required_argument, 0, O_INTRA},
                                       {"inter-gbps", required_argument, 0, O_INTER},
                                       {"precision", required_argument, 0, O_PREC},
                                       {"attention", required_argument, 0, O_ATTN},
                                       {"top", required_argument, 0, O_TOP},
                                       {"json", no_argument, 0, O_JSON},
                                       {"emit-spec", no_argument, 0, O_EMIT},
                                       {"job", required_argument, 0, O_JOB},
                                       {"layout", required_argument, 0, O_LAYOUT},
                                       {"latency-us", required_argument, 0, O_LAT},
                                       {"reserve-gib", required_argument, 0, O_RESERVE},
                                       {"help", no_argument, 0, O_HELP},
                                       {0, 0, 0, 0}};
  int ch, explicit_dims = 0, seq = 0, batch = 0, gpn = 0;
  double gib = 80, tflops = 989, intra = 450, inter = 50, lat_us = 10, reserve = 1;
  const char *job = NULL, *attention = NULL, *precision = NULL;
  a->cl.gpus = 0;
  a->cl.mfu = 0.4;
  a->tr.precision = DT_PLAN_BF16;
  a->top = 10;
  a->model.arch = DT_PLAN_GPT2;
  a->model.vocab = 50257;
  optind = 1;
  opterr = 0;
  int idx = 0;
  while ((ch = getopt_long(argc, argv, "h", opts, &idx)) != -1) {
    char o[64]; /* the option's name, for messages */
    snprintf(o, sizeof o, "--%s", ch >= O_MODEL ? opts[idx].name : "?");
    int rc = 0;
    switch (ch) {
    case O_MODEL:
      if (dt_plan_preset(optarg, &a->model) != 0)
        return bad("--model '%s': unknown preset (known: %s)", optarg, dt_plan_preset_names());
      a->model_name = optarg;
      a->have_model = 1;
      break;
    case O_LAYERS:
      rc = parse_int(o, optarg, 1, &a->model.layers), explicit_dims |= 1;
      break;
    case O_HIDDEN:
      rc = parse_int(o, optarg, 1, &a->model.hidden), explicit_dims |= 2;
      break;
    case O_HEADS:
      rc = parse_int(o, optarg, 1, &a->model.heads), explicit_dims |= 4;
      break;
    case O_KV:
      rc = parse_int(o, optarg, 1, &a->model.kv_heads), explicit_dims |= 8;
      break;
    case O_FFN:
      rc = parse_int(o, optarg, 1, &a->model.ffn), explicit_dims |= 8;
      break;
    case O_VOCAB:
      rc = parse_int(o, optarg, 2, &a->model.vocab), explicit_dims |= 8;
      break;
    case O_MAXSEQ:
      rc = parse_int(o, optarg, 1, &a->model.max_seq), explicit_dims |= 8;
      break;
    case O_ARCH:
      if (strcmp(optarg, "gpt2") != 0 && strcmp(optarg, "llama") != 0)
        return bad("--arch '%s': expected gpt2 or llama%s", optarg, "");
      a->model.arch = optarg[0] == 'l' ? DT_PLAN_LLAMA : DT_PLAN_GPT2;
      explicit_dims |= 8;
      break;
    case O_SEQ:
      rc = parse_int(o, optarg, 1, &seq);
      break;
    case O_BATCH:
      rc = parse_int(o, optarg, 1, &batch);
      break;
    case O_GPUS:
      rc = parse_int(o, optarg, 1, &a->cl.gpus);
      break;
    case O_GPN:
      rc = parse_int(o, optarg, 1, &gpn);
      break;
    case O_MEM:
      rc = parse_pos_double(o, optarg, &gib);
      break;
    case O_PEAK:
      rc = parse_pos_double(o, optarg, &tflops);
      break;
    case O_MFU:
      rc = parse_pos_double(o, optarg, &a->cl.mfu);
      if (rc == 0 && a->cl.mfu > 1)
        return bad("%s: the MFU is a fraction in (0, 1], got '%s'", o, optarg);
      break;
    case O_INTRA:
      rc = parse_pos_double(o, optarg, &intra);
      break;
    case O_INTER:
      rc = parse_pos_double(o, optarg, &inter);
      break;
    case O_LAT:
      rc = parse_pos_double(o, optarg, &lat_us);
      break;
    case O_RESERVE:
      rc = parse_double(o, optarg, 1, &reserve);
      break;
    case O_PREC:
      if (strcmp(optarg, "fp32") != 0 && strcmp(optarg, "bf16") != 0 &&
          strcmp(optarg, "mixed16") != 0)
        return bad("--precision '%s': expected bf16, fp32 or mixed16%s", optarg, "");
      precision = optarg;
      break;
    case O_ATTN:
      if (strcmp(optarg, "flash") != 0 && strcmp(optarg, "materialized") != 0)
        return bad("--attention '%s': expected flash or materialized%s", optarg, "");
      attention = optarg;
      break;
    case O_TOP:
      rc = parse_int(o, optarg, 1, &a->top);
      break;
    case O_JSON:
      a->json = 1;
      break;
    case O_EMIT:
      a->emit = 1;
      break;
    case O_JOB:
      job = optarg;
      break;
    case O_LAYOUT:
      rc = parse_layout(optarg, &a->layout);
      a->have_layout = 1;
      break;
    case 'h':
    case O_HELP:
      plan_usage(stdout);
      exit(0);
    default:
      return bad("unknown or incomplete option '%s'%s", argv[optind - 1], "");
    }
    if (rc != 0)
      return rc;
  }
  if (optind < argc)
    return bad("unexpected argument '%s'%s", argv[optind], "");
  if (job && (a->have_model || explicit_dims))
    return bad("--job takes the model from the job spec: leave out --model and the dimensions%s%s",
               "", "");
  if (job && load_job(job, a) != 0)
    return DT_EINVAL;
  if (attention) /* over the job spec's */
    a->tr.materialized = strcmp(attention, "materialized") == 0;
  if (precision)
    a->tr.precision = precision[0] == 'f'   ? DT_PLAN_FP32
                      : precision[0] == 'b' ? DT_PLAN_BF16
                                            : DT_PLAN_MIXED16;
  if (a->emit && a->tr.precision == DT_PLAN_MIXED16)
    return bad("--emit-spec: mixed16 is the textbook trainer's precision, not one distrain-train "
               "runs; plan with --precision bf16 or fp32%s%s",
               "", "");
  if (a->have_model && (explicit_dims & 7) && !job)
    return bad("--model and --layers/--hidden/--heads are exclusive%s%s", "", "");
  if (!a->have_model) {
    if ((explicit_dims & 7) != 7)
      return bad("a model is needed: --model PRESET (%s), --job JOB.yaml, or --layers, --hidden "
                 "and --heads%s",
                 dt_plan_preset_names(), "");
    a->model_name = "custom";
  }
  /* --seq / --global-batch override the job spec's; the presets' context is their default. */
  a->tr.seq = seq ? seq : a->tr.seq ? a->tr.seq : a->model.max_seq;
  if (batch)
    a->tr.global_batch = batch;
  if (!a->tr.seq)
    return bad("--seq is needed (the sequence length in tokens)%s%s", "", "");
  if (!a->tr.global_batch)
    return bad("--global-batch is needed (sequences per optimizer step)%s%s", "", "");
  if (a->have_layout) {
    dt_plan_layout_t *l = &a->layout;
    const int world = l->dp * l->tp * l->pp * l->cp;
    if (!a->cl.gpus)
      a->cl.gpus = world;
    if (l->micro == 0 && l->dp > 0)
      l->micro = a->tr.global_batch / l->dp;
    if (l->dp > 0 && l->micro > 0 && a->tr.global_batch % (l->dp * l->micro) != 0)
      return bad("--layout: dp x micro must divide the global batch (%s, batch %s)", "see above",
                 "as given");
    l->accum = l->micro > 0 && l->dp > 0 ? a->tr.global_batch / (l->dp * l->micro) : 0;
  }
  if (!a->cl.gpus)
    return bad("--gpus is needed (the GPUs of the job)%s%s", "", "");
  a->cl.gpus_per_node = gpn ? gpn : DT_MIN(8, a->cl.gpus);
  a->cl.gpu_mem = gib * GIB;
  a->cl.peak_flops = tflops * 1e12;
  a->cl.intra_bw = intra * 1e9;
  a->cl.inter_bw = inter * 1e9;
  a->cl.latency = lat_us * 1e-6;
  a->cl.reserve = reserve * GIB;
  char why[512];
  if (dt_plan_model_check(&a->model, a->tr.seq, why, sizeof why) != 0)
    return bad("model %s: %s", a->model_name, why);
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Output                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static void layout_name(const dt_plan_layout_t *l, char *buf, size_t n)
{
  char cp[16] = "";
  if (l->cp > 1)
    snprintf(cp, sizeof cp, " cp%d", l->cp);
  snprintf(buf, n, "dp%d tp%d pp%d%s b%dx%d", l->dp, l->tp, l->pp, cp, l->micro, l->accum);
}

static const char *precision_name(dt_plan_precision_t p)
{
  return p == DT_PLAN_BF16 ? "bf16" : p == DT_PLAN_FP32 ? "fp32" : "mixed16";
}

static const char *precision_line(dt_plan_precision_t p)
{
  return p == DT_PLAN_BF16   ? "bf16 as distrain-train runs it (fp32 master weights, gradients and "
                               "Adam m, v + a bf16 weight copy: 4+2+4+8 bytes/param)"
         : p == DT_PLAN_FP32 ? "fp32 (4+4+8 bytes/param)"
                             : "mixed16, the textbook 16-bit trainer (2+2+12 bytes/param; not "
                               "distrain's)";
}

static void print_header(FILE *out, const plan_args_t *a)
{
  const dt_plan_model_t *m = &a->model;
  fprintf(out, "model %s (%s): %lld parameters (layers %d, hidden %d, heads %d", a->model_name,
          m->arch == DT_PLAN_GPT2 ? "GPT-2" : "Llama", (long long)dt_plan_params(m), m->layers,
          m->hidden, m->heads);
  if (m->arch == DT_PLAN_LLAMA)
    fprintf(out, ", kv heads %d", m->kv_heads);
  fprintf(out, ", ffn %d, vocab %d); seq %d, global batch %d, %s, %s attention\n", m->ffn, m->vocab,
          a->tr.seq, a->tr.global_batch, precision_line(a->tr.precision),
          a->tr.materialized ? "materialized" : "flash");
  fprintf(out,
          "cluster: %d GPUs, %d per node, %.0f GiB each, %.0f TFLOP/s x MFU %.2f, intra-node %.0f "
          "GB/s, inter-node %.0f GB/s, %.0f us per collective, %.3g GiB left free\n",
          a->cl.gpus, a->cl.gpus_per_node, a->cl.gpu_mem / GIB, a->cl.peak_flops / 1e12, a->cl.mfu,
          a->cl.intra_bw / 1e9, a->cl.inter_bw / 1e9, a->cl.latency * 1e6, a->cl.reserve / GIB);
}

static void print_table(FILE *out, const dt_plan_eval_t *v, int n)
{
  fprintf(out, "%-24s %4s %4s %7s %7s %7s %7s %7s %6s %9s %8s %6s %9s %10s\n", "layout", "zero",
          "ckpt", "params", "grads", "optim", "work", "acts", "device", "total GiB", "comm GB",
          "bubble", "step s", "tokens/s");
  for (int i = 0; i < n; i++) {
    const dt_plan_eval_t *e = &v[i];
    char name[64];
    layout_name(&e->layout, name, sizeof name);
    fprintf(
        out,
        "%-24s %4d %4s %7.2f %7.2f %7.2f %7.2f %7.2f %6.2f %9.2f %8.2f %5.1f%% %9.3g %10.4g%s\n",
        name, e->layout.zero, e->layout.ckpt ? "on" : "off", e->mem.params / GIB,
        e->mem.grads / GIB, e->mem.optim / GIB, e->mem.working / GIB, e->mem.acts / GIB,
        e->mem.device / GIB, e->mem.total / GIB, e->comm / 1e9, 100 * e->bubble, e->t_step,
        e->tokens_per_s, e->fits ? "" : "  (does not fit)");
  }
}

static void json_mem(FILE *out, const dt_plan_mem_t *m)
{
  fprintf(out,
          "{\"params\": %.0f, \"grads\": %.0f, \"optim\": %.0f, \"working\": %.0f, \"acts\": %.0f, "
          "\"device\": %.0f, \"total\": %.0f}",
          m->params, m->grads, m->optim, m->working, m->acts, m->device, m->total);
}

static void json_eval(FILE *out, const plan_args_t *a, const dt_plan_eval_t *e, int stages)
{
  const dt_plan_layout_t *l = &e->layout;
  fprintf(out,
          "{\"dp\": %d, \"tp\": %d, \"pp\": %d, \"cp\": %d, \"zero\": %d, \"micro\": %d, "
          "\"accum\": %d, \"ckpt\": %s, \"fits\": %s, \"worst_stage\": %d, \"mem\": ",
          l->dp, l->tp, l->pp, l->cp, l->zero, l->micro, l->accum, l->ckpt ? "true" : "false",
          e->fits ? "true" : "false", e->worst_stage);
  json_mem(out, &e->mem);
  if (stages) {
    fputs(", \"stages\": [", out);
    for (int s = 0; s < l->pp; s++) {
      dt_plan_mem_t mem;
      dt_plan_memory(&a->model, &a->tr, l, s, &mem);
      fputs(s ? ", " : "", out);
      json_mem(out, &mem);
    }
    fputc(']', out);
  }
  fprintf(out,
          ", \"comm_bytes\": %.0f, \"comm_dp\": %.0f, \"comm_tp\": %.0f, \"comm_pp\": %.0f, "
          "\"comm_cp\": %.0f, \"t_compute\": %.6g, \"t_comm\": %.6g, \"t_step\": %.6g, "
          "\"bubble\": %.6g, \"tokens_per_s\": %.6g}",
          e->comm, e->comm_dp, e->comm_tp, e->comm_pp, e->comm_cp, e->t_compute, e->t_comm,
          e->t_step, e->bubble, e->tokens_per_s);
}

void dt_ctl_plan_emit_spec(FILE *out, const dt_plan_model_t *m, const dt_plan_train_t *tr,
                           const dt_plan_eval_t *e)
{
  const dt_plan_layout_t *l = &e->layout;
  fprintf(out,
          "# distrainctl plan: dp %d x tp %d x pp %d x cp %d, ZeRO-%d, micro-batch %d x %d "
          "accumulation steps, est. %.3g s/step, %.1f GiB per GPU\n",
          l->dp, l->tp, l->pp, DT_MAX(l->cp, 1), l->zero, l->micro, l->accum, e->t_step,
          e->mem.total / GIB);
  if (m->arch == DT_PLAN_GPT2)
    fprintf(out, "model:    {layers: %d, heads: %d, channels: %d, vocab: %d, max_seq: %d}\n",
            m->layers, m->heads, m->hidden, m->vocab, m->max_seq);
  else
    fprintf(out,
            "# model: Llama-shaped (layers %d, hidden %d, heads %d, kv heads %d, ffn %d, "
            "vocab %d): distrain's trainer builds GPT-2 shapes, so no model section\n",
            m->layers, m->hidden, m->heads, m->kv_heads, m->ffn, m->vocab);
  fprintf(out, "training: {batch: %d, seq: %d, micro_batch: %d%s%s}\n", tr->global_batch, tr->seq,
          l->micro, tr->precision == DT_PLAN_BF16 ? ", precision: bf16" : "",
          tr->materialized ? ", attention: materialized" : "");
  fprintf(out,
          "parallel: {dp: %d, tp: %d, pp: %d, cp: %d, zero_stage: %d, schedule: 1f1b, "
          "activation_checkpointing: %s}\n",
          l->dp, l->tp, l->pp, DT_MAX(l->cp, 1), l->zero, l->ckpt ? "true" : "false");
}

int dt_ctl_plan(int argc, char **argv)
{
  plan_args_t a;
  memset(&a, 0, sizeof a);
  if (parse_plan(argc, argv, &a) != 0) {
    fprintf(stderr, "(distrainctl plan --help for the options)\n");
    return 2;
  }
  char why[512];
  dt_plan_eval_t *v = NULL, one;
  int n = 0;
  if (a.have_layout) {
    if (dt_plan_layout_check(&a.model, &a.tr, &a.cl, &a.layout, why, sizeof why) != 0) {
      fprintf(stderr, "distrainctl plan: --layout: %s\n", why);
      return 2;
    }
    dt_plan_evaluate(&a.model, &a.tr, &a.cl, &a.layout, &one);
    v = &one;
    n = 1;
  } else {
    int rc = dt_plan_enumerate(&a.model, &a.tr, &a.cl, &v, &n, why, sizeof why);
    if (rc != 0) {
      fprintf(stderr, "distrainctl plan: %s\n", rc == DT_EINVAL ? why : dt_strerror(rc));
      return 2;
    }
    if (n == 0) {
      fprintf(stderr,
              "distrainctl plan: no valid layout of %d GPUs for this model and batch (tp must "
              "divide the heads %d and stay within a node of %d, pp divide the layers %d, dp = "
              "GPUs / (tp x pp) divide the global batch %d)\n",
              a.cl.gpus, a.model.heads, a.cl.gpus_per_node, a.model.layers, a.tr.global_batch);
      free(v);
      return 2;
    }
  }
  /* Degenerate cluster figures (a rate of 1e-300 TFLOP/s) overflow the model's arithmetic: an
   * error, not a table of inf and nan. */
  for (int i = 0; i < n; i++)
    if (!(isfinite(v[i].t_step) && v[i].t_step > 0 && isfinite(v[i].tokens_per_s))) {
      fprintf(stderr,
              "distrainctl plan: these figures give no finite step time (%g TFLOP/s at MFU %g, "
              "%g / %g GB/s, %g us): check --peak-tflops, --mfu, --intra-gbps, --inter-gbps "
              "and --latency-us\n",
              a.cl.peak_flops / 1e12, a.cl.mfu, a.cl.intra_bw / 1e9, a.cl.inter_bw / 1e9,
              a.cl.latency * 1e6);
      if (v != &one)
        free(v);
      return 2;
    }
  const int rec = v[0].fits ? 0 : -1; /* sorted: the fastest that fits comes first */
  if (a.json) {
    fprintf(stdout, "{\"model\": {\"name\": ");
    dt_json_string(stdout, a.model_name);
    fprintf(stdout,
            ", \"arch\": \"%s\", \"params\": %lld, \"layers\": %d, \"hidden\": %d, \"heads\": %d, "
            "\"kv_heads\": %d, \"ffn\": %d, \"vocab\": %d}, \"seq\": %d, \"global_batch\": %d, "
            "\"precision\": \"%s\", \"attention\": \"%s\", \"gpus\": %d, \"reserve\": %.0f, "
            "\"layouts\": [",
            a.model.arch == DT_PLAN_GPT2 ? "gpt2" : "llama", (long long)dt_plan_params(&a.model),
            a.model.layers, a.model.hidden, a.model.heads, a.model.kv_heads, a.model.ffn,
            a.model.vocab, a.tr.seq, a.tr.global_batch, precision_name(a.tr.precision),
            a.tr.materialized ? "materialized" : "flash", a.cl.gpus, a.cl.reserve);
    for (int i = 0; i < DT_MIN(n, a.top); i++) {
      fputs(i ? ",\n  " : "\n  ", stdout);
      json_eval(stdout, &a, &v[i], a.have_layout);
    }
    fprintf(stdout, "],\n \"valid_layouts\": %d, \"recommended\": %s}\n", n,
            rec == 0 ? "0" : "null");
  } else if (!a.emit) {
    print_header(stdout, &a);
    print_table(stdout, v, DT_MIN(n, a.top));
    if (n > a.top)
      printf("(%d more valid layouts; --top N shows more)\n", n - a.top);
  }
  int code = 0;
  if (rec == 0 && !a.json) {
    char name[64];
    layout_name(&v[0].layout, name, sizeof name);
    if (!a.emit)
      printf("recommended: %s ZeRO-%d, activation checkpointing %s: %.1f GiB per GPU, %.3g s per "
             "step, %.4g tokens/s\n",
             name, v[0].layout.zero, v[0].layout.ckpt ? "on" : "off", v[0].mem.total / GIB,
             v[0].t_step, v[0].tokens_per_s);
    else
      dt_ctl_plan_emit_spec(stdout, &a.model, &a.tr, &v[0]);
  } else if (rec != 0) {
    char name[64];
    layout_name(&v[0].layout, name, sizeof name); /* the rest are sorted by memory */
    fprintf(stderr,
            "distrainctl plan: nothing fits in %.0f GiB per GPU (%.3g GiB left free): the smallest "
            "layout, %s ZeRO-%d checkpointing %s, needs %.1f GiB\n",
            a.cl.gpu_mem / GIB, a.cl.reserve / GIB, name, v[0].layout.zero,
            v[0].layout.ckpt ? "on" : "off", v[0].mem.total / GIB);
    code = 1;
  }
  if (v != &one)
    free(v);
  return code;
}
