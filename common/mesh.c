/* mesh.c — rank <-> coordinate arithmetic for the pp x dp x cp x tp mesh and the placement of
 * ranks on nodes. See mesh.h for the rank formula and the placement policy. */
#include "mesh.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dt_error.h"
#include "dt_util.h"

/* The mesh and a coordinate as arrays, outermost axis first, so that the arithmetic is one
 * mixed-radix loop instead of four hand-written cases. */
static void mesh_dims(const dt_mesh_t *m, int d[DT_MESH_NAXES])
{
  d[DT_MESH_PP] = m->pp;
  d[DT_MESH_DP] = m->dp;
  d[DT_MESH_CP] = m->cp;
  d[DT_MESH_TP] = m->tp;
}

static void coord_to_array(const dt_mesh_coord_t *c, int a[DT_MESH_NAXES])
{
  a[DT_MESH_PP] = c->pp;
  a[DT_MESH_DP] = c->dp;
  a[DT_MESH_CP] = c->cp;
  a[DT_MESH_TP] = c->tp;
}

static void coord_from_array(const int a[DT_MESH_NAXES], dt_mesh_coord_t *c)
{
  c->pp = a[DT_MESH_PP];
  c->dp = a[DT_MESH_DP];
  c->cp = a[DT_MESH_CP];
  c->tp = a[DT_MESH_TP];
}

int dt_mesh_world(const dt_mesh_t *mesh)
{
  int d[DT_MESH_NAXES];
  if (!mesh)
    return DT_EINVAL;
  mesh_dims(mesh, d);
  long long world = 1;
  for (int i = 0; i < DT_MESH_NAXES; i++) {
    if (d[i] < 1)
      return DT_EINVAL;
    world *= d[i];
    if (world > INT_MAX)
      return DT_ERANGE;
  }
  return (int)world;
}

int dt_mesh_init(dt_mesh_t *mesh, int pp, int dp, int cp, int tp)
{
  dt_mesh_t m = {.pp = pp, .dp = dp, .cp = cp, .tp = tp};
  int world = dt_mesh_world(&m);
  if (world < 0)
    return world;
  *mesh = m;
  return 0;
}

int dt_mesh_axis_size(const dt_mesh_t *mesh, dt_mesh_axis_t axis)
{
  int d[DT_MESH_NAXES];
  if ((int)axis < 0 || axis >= DT_MESH_NAXES)
    return DT_EINVAL;
  mesh_dims(mesh, d);
  return d[axis];
}

const char *dt_mesh_axis_name(dt_mesh_axis_t axis)
{
  static const char *const names[DT_MESH_NAXES] = {"pp", "dp", "cp", "tp"};
  return (int)axis >= 0 && axis < DT_MESH_NAXES ? names[axis] : "?";
}

void dt_mesh_format(const dt_mesh_t *mesh, char *buf, size_t n)
{
  if (n == 0)
    return;
  snprintf(buf, n, "pp %d x dp %d x cp %d x tp %d", mesh->pp, mesh->dp, mesh->cp, mesh->tp);
}

int dt_mesh_coords(const dt_mesh_t *mesh, int rank, dt_mesh_coord_t *out)
{
  int world = dt_mesh_world(mesh);
  if (world < 0)
    return world;
  if (rank < 0 || rank >= world)
    return DT_ERANGE;
  int d[DT_MESH_NAXES], a[DT_MESH_NAXES];
  mesh_dims(mesh, d);
  /* Peel the mixed-radix digits off from the fastest axis (tp) outwards. */
  for (int i = DT_MESH_NAXES - 1; i >= 0; i--) {
    a[i] = rank % d[i];
    rank /= d[i];
  }
  coord_from_array(a, out);
  return 0;
}

int dt_mesh_rank(const dt_mesh_t *mesh, const dt_mesh_coord_t *coord)
{
  int world = dt_mesh_world(mesh);
  if (world < 0)
    return world;
  int d[DT_MESH_NAXES], a[DT_MESH_NAXES];
  mesh_dims(mesh, d);
  coord_to_array(coord, a);
  int rank = 0;
  for (int i = 0; i < DT_MESH_NAXES; i++) {
    if (a[i] < 0 || a[i] >= d[i])
      return DT_ERANGE;
    rank = rank * d[i] + a[i]; /* < world <= INT_MAX at every step */
  }
  return rank;
}

int dt_mesh_group(const dt_mesh_t *mesh, int rank, dt_mesh_axis_t axis, int *ranks)
{
  dt_mesh_coord_t c;
  int rc = dt_mesh_coords(mesh, rank, &c);
  if (rc < 0)
    return rc;
  int n = dt_mesh_axis_size(mesh, axis);
  if (n < 0)
    return n;
  int a[DT_MESH_NAXES];
  coord_to_array(&c, a);
  for (int i = 0; i < n; i++) {
    a[axis] = i;
    dt_mesh_coord_t peer;
    coord_from_array(a, &peer);
    ranks[i] = dt_mesh_rank(mesh, &peer);
  }
  return n;
}

int dt_mesh_parse_partition(const char *text, int pp, int total_layers, int *layers, char *why,
                            size_t whylen)
{
  const char *p = text;
  int n = 0;
  long long sum = 0; /* of up to pp counts, each up to total_layers */
  while (*p) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 1 || v > total_layers || (*end && *end != ',') || n == pp) {
      snprintf(why, whylen,
               "parallel.partition '%s': expected %d positive layer counts separated by commas, "
               "one per pipeline stage",
               text, pp);
      return DT_EINVAL;
    }
    layers[n++] = (int)v;
    sum += v;
    p = *end ? end + 1 : end;
  }
  if (n != pp || sum != total_layers) {
    snprintf(why, whylen,
             "parallel.partition '%s' gives %d stages %lld layers: it must give each of the %d "
             "stages its layers and cover all %d",
             text, n, sum, pp, total_layers);
    return DT_EINVAL;
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Placement                                                                                   */
/* ------------------------------------------------------------------------------------------ */

void dt_placement_free(dt_placement_t *p)
{
  if (!p)
    return;
  free(p->ranks);
  free(p->node_nranks);
  free(p->node_first);
  memset(p, 0, sizeof *p);
}

int dt_mesh_place(const dt_mesh_t *mesh, const int *node_devices, int nnodes, dt_placement_t *out,
                  char *why, size_t whylen)
{
  char shape[96];
  int ret = 0;
  memset(out, 0, sizeof *out);
  if (whylen > 0)
    why[0] = '\0';

  int world = dt_mesh_world(mesh);
  if (world < 0) {
    snprintf(why, whylen, "invalid mesh (every size must be >= 1 and the world must fit an int)");
    return world;
  }
  if (nnodes < 0 || (nnodes > 0 && !node_devices)) {
    snprintf(why, whylen, "invalid node list");
    return DT_EINVAL;
  }

  /* What the nodes can hold: a node's usable devices are whole tensor-parallel groups. */
  const int tp = mesh->tp;
  long long total = 0, usable = 0;
  int largest = 0;
  for (int i = 0; i < nnodes; i++) {
    if (node_devices[i] < 0) {
      snprintf(why, whylen, "node %d reports %d devices", i, node_devices[i]);
      return DT_EINVAL;
    }
    total += node_devices[i];
    usable += (long long)(node_devices[i] / tp) * tp;
    largest = DT_MAX(largest, node_devices[i]);
  }
  dt_mesh_format(mesh, shape, sizeof shape);
  if (tp > 1 && largest < tp) {
    snprintf(why, whylen, "tp=%d needs %d devices on one node; the largest node has %d", tp, tp,
             largest);
    return DT_EUNAVAIL;
  }
  if (usable < world) {
    const char *ds = world == 1 ? "" : "s";
    const char *ns = nnodes == 1 ? "" : "s";
    const char *verb = nnodes == 1 ? "offers" : "offer";
    if (usable < total)
      snprintf(why, whylen,
               "world %d (%s) needs %d device%s, %d node%s %s %lld (%lld devices, but tensor-"
               "parallel groups of %d cannot span nodes)",
               world, shape, world, ds, nnodes, ns, verb, usable, total, tp);
    else
      snprintf(why, whylen, "world %d (%s) needs %d device%s, %d node%s %s %lld", world, shape,
               world, ds, nnodes, ns, verb, usable);
    return DT_EUNAVAIL;
  }

  out->ranks = calloc((size_t)world, sizeof *out->ranks);
  out->node_nranks = calloc((size_t)nnodes, sizeof *out->node_nranks);
  out->node_first = malloc((size_t)nnodes * sizeof *out->node_first);
  if (!out->ranks || !out->node_nranks || !out->node_first) {
    snprintf(why, whylen, "out of memory placing %d ranks", world);
    ret = DT_ENOMEM;
    goto fail;
  }
  out->mesh = *mesh;
  out->world = world;
  out->nnodes = nnodes;

  /* Fill nodes in order. Each node takes a multiple of tp ranks and world is a multiple of tp,
   * so every node's first rank is a multiple of tp: tensor-parallel groups stay whole. */
  int next = 0;
  for (int i = 0; i < nnodes; i++) {
    out->node_first[i] = -1;
    int take = DT_MIN((node_devices[i] / tp) * tp, world - next);
    if (take <= 0)
      continue;
    out->node_first[i] = next;
    out->node_nranks[i] = take;
    out->nodes_used++;
    for (int l = 0; l < take; l++, next++) {
      dt_rank_place_t *r = &out->ranks[next];
      r->rank = next;
      r->node = i;
      r->local_rank = l;
      r->device = l;
      dt_mesh_coords(mesh, next, &r->coord);
    }
  }
  if (next != world) { /* unreachable: usable >= world was checked above */
    snprintf(why, whylen, "internal error: placed %d of %d ranks", next, world);
    ret = DT_EINTERNAL;
    goto fail;
  }
  return 0;

fail:
  dt_placement_free(out);
  return ret;
}
