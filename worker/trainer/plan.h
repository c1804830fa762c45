/* plan.h — the parallel plan of one trainer: where this rank sits in the pp x dp x cp x tp
 * mesh, whether the model can be laid out on it, and the communicators of its groups.
 *
 * Built once at start-up, before any weight is allocated. Every layout rule is checked here
 * with one clear error naming the key and the rule (dt_plan_check), then the named groups are
 * split from the world communicator (dt_plan_create): tp (tensor-parallel peers, neighbours in
 * rank order), cp (the ranks splitting a sequence), dp (the ranks holding the same part of the
 * model: data and context parallel, whose gradients are averaged and ZeRO-sharded together). A
 * group of one rank has no communicator (NULL); a group that is the whole world uses the world
 * communicator itself. */
#ifndef DT_TRAINER_PLAN_H
#define DT_TRAINER_PLAN_H

#include <stddef.h>

#include "comm.h"
#include "gpt2.h"
#include "mesh.h"

typedef struct {
  dt_mesh_t mesh;
  dt_mesh_coord_t coord;
  int rank, world;
  dt_gpt2_stage_t stage; /* this rank's pipeline stage: its chunks of layers */
  dt_comm_t *tp;         /* this rank's tensor-parallel group, or NULL (tp = 1) */
  dt_comm_t *dp;         /* its gradient group, dp x cp ranks, or NULL (dp = cp = 1) */
  dt_comm_t *pp;         /* its pipeline (the stages of its tp/dp position), or NULL (pp = 1) */
  dt_comm_t *emb; /* first and last stage (tied embeddings), or NULL (pp = 1; other stages) */
  dt_comm_t *mp;  /* every rank holding a part of its replica (tp x pp), or NULL */
  dt_comm_t *cp;  /* its context-parallel group (one sequence's chunks), or NULL (cp = 1) */
  /* private: which of the above this plan created (and destroys) */
  int owns[6];
} dt_plan_t;

/* Layers per virtual stage (pp x virtual stages per rank: stages of an interleaved
 * pipeline): balanced by cost, the LM head counted on the last (its GEMM is Vp x C per token
 * against a layer's 12 C^2), or the explicit split given (NULL: balanced). bounds gets
 * stages + 1 entries: virtual stage k holds layers [bounds[k], bounds[k + 1]). */
int dt_plan_partition(const dt_gpt2_config_t *cfg, int stages, const int *explicit_layers,
                      int *bounds, char *why, size_t whylen);

/* Parses DISTRAIN_MESH's "pp1,dp2,cp1,tp2" (each axis once, in any order). */
int dt_plan_parse_mesh(const char *text, dt_mesh_t *mesh, char *why, size_t whylen);
/* Checks the mesh against the model and the sequence length; one-line reason on failure. */
int dt_plan_check(const dt_mesh_t *mesh, const dt_gpt2_config_t *cfg, int seq, char *why,
                  size_t whylen);
/* Splits the groups of rank dt_comm_rank(world) from world (NULL: one process); collective
 * over world. bounds: the partition into mesh->pp x chunks virtual stages
 * (dt_plan_partition); stage s holds virtual stages s, s + pp, ... as its chunks. The plan
 * borrows world, which must outlive it. */
int dt_plan_create(dt_plan_t *plan, const dt_mesh_t *mesh, const int *bounds, int chunks,
                   dt_comm_t *world);
void dt_plan_destroy(dt_plan_t *plan);
/* Logs which part of the model this rank holds (heads, vocabulary rows, dp shard). */
void dt_plan_log(const dt_plan_t *plan, const dt_gpt2_config_t *cfg);

#endif
