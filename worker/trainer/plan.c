/* plan.c — see plan.h. */
#include "plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_log.h"
#include "planner.h"
#include "dt_util.h"

int dt_plan_parse_mesh(const char *text, dt_mesh_t *mesh, char *why, size_t whylen)
{
  int v[DT_MESH_NAXES] = {0, 0, 0, 0};
  const char *p = text;
  while (p && *p) {
    int axis = -1;
    for (int a = 0; a < DT_MESH_NAXES; a++)
      if (strncmp(p, dt_mesh_axis_name((dt_mesh_axis_t)a), 2) == 0)
        axis = a;
    char *end;
    long n = axis >= 0 ? strtol(p + 2, &end, 10) : 0;
    if (axis < 0 || end == p + 2 || n < 1 || n > 1 << 20 || v[axis] || (*end && *end != ',') ||
        (*end == ',' && !end[1])) {
      snprintf(why, whylen, "DISTRAIN_MESH='%s': expected pp<N>,dp<N>,cp<N>,tp<N>", text);
      return DT_EINVAL;
    }
    v[axis] = (int)n;
    p = *end ? end + 1 : end;
  }
  for (int a = 0; a < DT_MESH_NAXES; a++)
    v[a] = v[a] ? v[a] : 1;
  if (dt_mesh_init(mesh, v[DT_MESH_PP], v[DT_MESH_DP], v[DT_MESH_CP], v[DT_MESH_TP]) != 0) {
    snprintf(why, whylen, "DISTRAIN_MESH='%s': the world it describes is too large", text);
    return DT_EINVAL;
  }
  return 0;
}

int dt_plan_check(const dt_mesh_t *mesh, const dt_gpt2_config_t *cfg, int seq, char *why,
                  size_t whylen)
{
  if (mesh->pp > cfg->layers) {
    snprintf(why, whylen, "parallel.pp (%d) must be <= model.layers (%d)", mesh->pp, cfg->layers);
    return DT_EINVAL;
  }
  if (mesh->cp > 1 && seq % (2 * mesh->cp) != 0) {
    snprintf(why, whylen,
             "training.seq (%d) must be divisible by 2 x parallel.cp (%d): context parallelism "
             "splits each sequence into 2 x cp chunks",
             seq, mesh->cp);
    return DT_EINVAL;
  }
  return dt_gpt2_tp_validate(cfg, mesh->tp, why, whylen);
}

int dt_plan_partition(const dt_gpt2_config_t *cfg, int pp, const int *explicit_layers, int *bounds,
                      char *why, size_t whylen)
{
  const int L = cfg->layers;
  if (pp > L) {
    snprintf(why, whylen,
             "model.layers (%d) must be >= parallel.pp x parallel.virtual_stages (%d): every "
             "pipeline stage needs a layer",
             L, pp);
    return DT_EINVAL;
  }
  bounds[0] = 0;
  if (explicit_layers) {
    for (int s = 0; s < pp; s++) {
      if (explicit_layers[s] < 1) {
        snprintf(why, whylen, "parallel.partition: stage %d gets %d layers; every stage needs >= 1",
                 s, explicit_layers[s]);
        return DT_EINVAL;
      }
      bounds[s + 1] = bounds[s] + explicit_layers[s];
    }
    if (bounds[pp] != L) {
      snprintf(why, whylen,
               "parallel.partition covers %d layers, model.layers is %d: the stages must cover "
               "every layer once",
               bounds[pp], L);
      return DT_EINVAL;
    }
    return 0;
  }
  /* Costs in units of one layer: the LM head's GEMM against a layer's 12 C^2 per token. */
  dt_plan_stage_bounds(L, (double)cfg->padded_vocab / (12.0 * cfg->channels), pp, bounds);
  return 0;
}

/* The communicator of this rank's group along one axis: NULL for a group of one, the world
 * for a group that spans it (unless own: a communicator of its own then too), else a split
 * (collective over world: every rank splits every axis in the same order). Color: the group's
 * first rank; key: the position along the axis. */
static int group_comm(const dt_mesh_t *mesh, dt_comm_t *world, dt_mesh_axis_t axis, int own,
                      dt_comm_t **out, int *owned)
{
  const int n = dt_mesh_axis_size(mesh, axis), wsize = dt_mesh_world(mesh);
  *out = NULL;
  *owned = 0;
  if (n == 1)
    return 0;
  if (n == wsize && !own) {
    *out = world;
    return 0;
  }
  int *ranks = calloc((size_t)n, sizeof *ranks);
  if (!ranks)
    return DT_ENOMEM;
  const int me = dt_comm_rank(world);
  int rc = dt_mesh_group(mesh, me, axis, ranks);
  int key = 0;
  for (int i = 0; i < n; i++)
    key = ranks[i] == me ? i : key;
  if (rc >= 0)
    rc = dt_comm_split(world, ranks[0], key, out);
  free(ranks);
  *owned = rc == 0;
  return rc < 0 ? rc : 0;
}

/* The first and last stage of this rank's pipeline: its embedding group. Collective over
 * world: every rank takes part in the split, the middle stages with no color. */
static int emb_comm(const dt_mesh_t *mesh, const dt_mesh_coord_t *c, dt_comm_t *world,
                    dt_comm_t **out, int *owned)
{
  const int ends = c->pp == 0 || c->pp == mesh->pp - 1;
  const int color = ends ? (c->dp * mesh->cp + c->cp) * mesh->tp + c->tp : DT_COMM_NO_COLOR;
  *out = NULL;
  int rc = dt_comm_split(world, color, c->pp, out);
  *owned = rc == 0 && *out;
  return rc;
}

/* The ranks holding the same part of the model: every dp and cp position at this rank's pp
 * and tp coordinates (gradients are averaged, and ZeRO shards, over them). Collective over
 * world. */
static int grad_comm(const dt_mesh_t *mesh, const dt_mesh_coord_t *c, dt_comm_t *world,
                     dt_comm_t **out, int *owned)
{
  *out = NULL;
  *owned = 0;
  if (mesh->cp == 1)
    return group_comm(mesh, world, DT_MESH_DP, 0, out, owned);
  if (mesh->pp * mesh->tp == 1) {
    *out = world;
    return 0;
  }
  int rc = dt_comm_split(world, c->pp * mesh->tp + c->tp, c->dp * mesh->cp + c->cp, out);
  *owned = rc == 0;
  return rc;
}

/* The ranks holding the other parts of this rank's model replica: every pp and tp position
 * at its dp (and cp) coordinates. */
static int mp_comm(const dt_mesh_t *mesh, const dt_mesh_coord_t *c, dt_comm_t *world,
                   dt_comm_t **out, int *owned)
{
  *out = NULL;
  *owned = 0;
  if (mesh->pp * mesh->tp == 1)
    return 0;
  if (mesh->dp * mesh->cp == 1) {
    *out = world;
    return 0;
  }
  int rc = dt_comm_split(world, c->dp * mesh->cp + c->cp, dt_comm_rank(world), out);
  *owned = rc == 0;
  return rc;
}

int dt_plan_create(dt_plan_t *plan, const dt_mesh_t *mesh, const int *bounds, int chunks,
                   dt_comm_t *world)
{
  memset(plan, 0, sizeof *plan);
  plan->mesh = *mesh;
  plan->world = world ? dt_comm_world(world) : 1;
  plan->rank = world ? dt_comm_rank(world) : 0;
  if (dt_mesh_world(mesh) != plan->world) {
    char m[96];
    dt_mesh_format(mesh, m, sizeof m);
    DT_ERROR(TRAIN, "the mesh (%s) has %d ranks but WORLD_SIZE is %d", m, dt_mesh_world(mesh),
             plan->world);
    return DT_EINVAL;
  }
  DT_CHECK(dt_mesh_coords(mesh, plan->rank, &plan->coord));
  const int s = plan->coord.pp;
  plan->stage = (dt_gpt2_stage_t){.chunks = chunks, .first = s == 0, .last = s == mesh->pp - 1};
  for (int c = 0; c < chunks; c++) {
    plan->stage.lo[c] = bounds[c * mesh->pp + s];
    plan->stage.hi[c] = bounds[c * mesh->pp + s + 1];
  }
  if (!world)
    return 0;
  int rc = group_comm(mesh, world, DT_MESH_TP, 0, &plan->tp, &plan->owns[0]);
  if (rc == 0)
    rc = grad_comm(mesh, &plan->coord, world, &plan->dp, &plan->owns[1]);
  /* The model's attention collectives run on cp while the gradient group (the world, when cp
   * spans it) may be busy on the data-parallel comm thread: cp never shares a communicator. */
  if (rc == 0)
    rc = group_comm(mesh, world, DT_MESH_CP, 1, &plan->cp, &plan->owns[5]);
  if (rc == 0)
    rc = group_comm(mesh, world, DT_MESH_PP, 0, &plan->pp, &plan->owns[2]);
  if (rc == 0 && mesh->pp > 1)
    rc = emb_comm(mesh, &plan->coord, world, &plan->emb, &plan->owns[3]);
  if (rc == 0)
    rc = mp_comm(mesh, &plan->coord, world, &plan->mp, &plan->owns[4]);
  /* Progress reports name the groups (a group that is the whole world stays "world"). */
  dt_comm_t *comms[6] = {plan->tp, plan->dp, plan->pp, plan->emb, plan->mp, plan->cp};
  static const char *const labels[6] = {"tp", "dp", "pp", "emb", "mp", "cp"};
  for (int i = 0; rc == 0 && i < 6; i++)
    if (plan->owns[i])
      dt_comm_set_label(comms[i], labels[i]);
  if (rc != 0) {
    DT_ERROR(TRAIN, "cannot form the parallel groups: %s", dt_strerror(rc));
    dt_plan_destroy(plan);
  }
  return rc;
}

void dt_plan_destroy(dt_plan_t *plan)
{
  dt_comm_t *comms[6] = {plan->tp, plan->dp, plan->pp, plan->emb, plan->mp, plan->cp};
  for (int i = 0; i < 6; i++)
    if (plan->owns[i])
      dt_comm_destroy(comms[i]);
  memset(plan, 0, sizeof *plan);
}

void dt_plan_log(const dt_plan_t *plan, const dt_gpt2_config_t *cfg)
{
  char m[96];
  const dt_mesh_t *ms = &plan->mesh;
  const dt_mesh_coord_t *c = &plan->coord;
  const int heads = cfg->heads / ms->tp, rows = cfg->padded_vocab / ms->tp;
  const dt_gpt2_stage_t *st = &plan->stage;
  char layers[256];
  size_t n = 0;
  for (int k = 0; k < st->chunks && n < sizeof layers; k++)
    n += (size_t)snprintf(layers + n, sizeof layers - n, "%s%d..%d", k ? ", " : "", st->lo[k],
                          st->hi[k] - 1);
  dt_mesh_format(ms, m, sizeof m);
  DT_INFO(TRAIN,
          "plan: rank %d of %d in %s at pp %d tp %d dp %d cp %d: layers %s%s%s, heads %d..%d "
          "of %d, vocabulary rows %d..%d of %d, data-parallel shard %d of %d, sequence chunk "
          "%d of %d",
          plan->rank, plan->world, m, c->pp, c->tp, c->dp, c->cp, layers,
          st->first ? " + embeddings" : "", st->last ? " + LM head" : "", c->tp * heads,
          (c->tp + 1) * heads - 1, cfg->heads, c->tp * rows, (c->tp + 1) * rows - 1,
          cfg->padded_vocab, c->dp, ms->dp, c->cp, ms->cp);
}
