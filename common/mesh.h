/* mesh.h — the 4-D device mesh (pipeline x data x context x tensor parallel) and the placement
 * of its ranks on nodes.
 *
 * Rank order: world = pp * dp * cp * tp and
 *   rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
 * so tp varies fastest (tensor-parallel peers are neighbours, hence on one node) and pipeline
 * stages are outermost. Every function here is pure arithmetic on caller-owned structs except
 * dt_mesh_place, which allocates the placement it returns (free with dt_placement_free). */
#ifndef DT_MESH_H
#define DT_MESH_H

#include <stddef.h>

/* Sizes along each axis, each >= 1; their product (the world) fits in an int. */
typedef struct {
  int pp, dp, cp, tp;
} dt_mesh_t;

/* A position in the mesh: 0 <= pp < mesh.pp and so on. */
typedef struct {
  int pp, dp, cp, tp;
} dt_mesh_coord_t;

/* Axes, outermost first (the order of the rank formula). */
typedef enum {
  DT_MESH_PP = 0,
  DT_MESH_DP = 1,
  DT_MESH_CP = 2,
  DT_MESH_TP = 3,
  DT_MESH_NAXES = 4,
} dt_mesh_axis_t;

/* Fills mesh after checking every size is >= 1 (DT_EINVAL) and the world fits (DT_ERANGE). */
int dt_mesh_init(dt_mesh_t *mesh, int pp, int dp, int cp, int tp);
/* pp * dp * cp * tp, or DT_EINVAL / DT_ERANGE for a mesh dt_mesh_init would refuse. */
int dt_mesh_world(const dt_mesh_t *mesh);
/* Size along one axis (DT_EINVAL for an unknown axis). */
int dt_mesh_axis_size(const dt_mesh_t *mesh, dt_mesh_axis_t axis);
/* "pp", "dp", "cp", "tp" ("?" otherwise). */
const char *dt_mesh_axis_name(dt_mesh_axis_t axis);
/* "pp 1 x dp 8 x cp 1 x tp 1" into buf (always NUL-terminated). */
void dt_mesh_format(const dt_mesh_t *mesh, char *buf, size_t n);

/* rank -> coordinates. 0, or DT_ERANGE when rank is outside [0, world). */
int dt_mesh_coords(const dt_mesh_t *mesh, int rank, dt_mesh_coord_t *out);
/* coordinates -> rank (>= 0), or DT_ERANGE when a coordinate is outside its axis. */
int dt_mesh_rank(const dt_mesh_t *mesh, const dt_mesh_coord_t *coord);
/* The ranks that share every coordinate with rank except along axis, in axis order: the group a
 * sub-communicator for that axis spans (rank included). ranks must hold
 * dt_mesh_axis_size(axis) entries. Returns that count, or DT_ERANGE / DT_EINVAL. */
int dt_mesh_group(const dt_mesh_t *mesh, int rank, dt_mesh_axis_t axis, int *ranks);

/* An explicit pipeline partition, "3,1": layers per stage, comma-separated. Fills layers[0..pp)
 * after checking there are pp positive counts that add up to total_layers; otherwise DT_EINVAL
 * and a one-line reason naming parallel.partition and the rule. */
int dt_mesh_parse_partition(const char *text, int pp, int total_layers, int *layers, char *why,
                            size_t whylen);

/* ------------------------------------------------------------------------------------------ */
/* Placement                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* Where one global rank runs. */
typedef struct {
  int rank;              /* global rank; also its index in dt_placement_t.ranks */
  int node;              /* index into the node list given to dt_mesh_place */
  int local_rank;        /* 0.. on that node, in global-rank order */
  int device;            /* device ordinal on that node (today equal to local_rank) */
  dt_mesh_coord_t coord; /* mesh coordinates of rank */
} dt_rank_place_t;

/* A whole job's placement. Nodes that received no rank have node_nranks 0 and node_first -1. */
typedef struct {
  dt_mesh_t mesh;
  int world;
  dt_rank_place_t *ranks; /* (world) by global rank */
  int nnodes;             /* length of the node list that was placed on */
  int nodes_used;         /* nodes with at least one rank */
  int *node_nranks;       /* (nnodes) ranks on each node: its local world size */
  int *node_first;        /* (nnodes) first global rank on each node, or -1 */
} dt_placement_t;

/* Places the mesh's ranks on nodes given in order with their device counts (node_devices,
 * (nnodes)). Policy: walk the nodes in order; a node contributes floor(devices / tp) * tp
 * devices at most (so a tensor-parallel group never spans nodes), taking the next consecutive
 * global ranks on devices 0, 1, ...; stop once world ranks are placed. Nodes and devices not
 * needed are left out. On success *out owns its arrays (dt_placement_free). On failure *out is
 * empty (safe to free), why holds the reason and the return is DT_EUNAVAIL when the nodes are
 * too few or too small ("tp=4 needs 4 devices on one node; the largest node has 2", "world 8
 * (pp 1 x dp 8 x cp 1 x tp 1) needs 8 devices, 3 nodes offer 6"), DT_EINVAL for a bad mesh or
 * a negative device count, DT_ENOMEM. */
int dt_mesh_place(const dt_mesh_t *mesh, const int *node_devices, int nnodes, dt_placement_t *out,
                  char *why, size_t whylen);
void dt_placement_free(dt_placement_t *p);

#endif
