/* test_mesh.c — Check suite for common/mesh: the rank formula and its inverse over every rank of
 * several meshes, axis groups, and the placement of ranks on uneven nodes with its error
 * reasons. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <check.h>

#include "dt_error.h"
#include "mesh.h"

/* The meshes walked rank by rank: {pp, dp, cp, tp}. */
static const int g_meshes[][4] = {
    {1, 1, 1, 1}, {2, 2, 1, 2}, {1, 8, 1, 1}, {4, 1, 1, 1}, {1, 1, 1, 8},
    {2, 3, 2, 2}, {3, 2, 5, 7}, {1, 2, 4, 1}, {2, 1, 1, 4},
};

static dt_mesh_t mesh_of(const int m[4])
{
  dt_mesh_t mesh;
  ck_assert_int_eq(dt_mesh_init(&mesh, m[0], m[1], m[2], m[3]), 0);
  return mesh;
}

/* ------------------------------------------------------------------------------------------ */
/* Arithmetic                                                                                  */
/* ------------------------------------------------------------------------------------------ */

START_TEST(test_init_and_world)
{
  dt_mesh_t m;
  ck_assert_int_eq(dt_mesh_init(&m, 2, 2, 1, 2), 0);
  ck_assert_int_eq(m.pp, 2);
  ck_assert_int_eq(m.dp, 2);
  ck_assert_int_eq(m.cp, 1);
  ck_assert_int_eq(m.tp, 2);
  ck_assert_int_eq(dt_mesh_world(&m), 8);
  ck_assert_int_eq(dt_mesh_axis_size(&m, DT_MESH_PP), 2);
  ck_assert_int_eq(dt_mesh_axis_size(&m, DT_MESH_CP), 1);
  ck_assert_int_eq(dt_mesh_axis_size(&m, DT_MESH_NAXES), DT_EINVAL);

  /* Every size must be >= 1; a refused init leaves the mesh alone. */
  dt_mesh_t keep = m;
  ck_assert_int_eq(dt_mesh_init(&m, 0, 1, 1, 1), DT_EINVAL);
  ck_assert_int_eq(dt_mesh_init(&m, 1, -2, 1, 1), DT_EINVAL);
  ck_assert_int_eq(dt_mesh_init(&m, 1, 1, 0, 1), DT_EINVAL);
  ck_assert_int_eq(dt_mesh_init(&m, 1, 1, 1, 0), DT_EINVAL);
  ck_assert_int_eq(dt_mesh_init(&m, 65536, 65536, 1, 1), DT_ERANGE);
  ck_assert_int_eq(dt_mesh_init(&m, 1 << 15, 1 << 15, 2, 1), DT_ERANGE);
  ck_assert_mem_eq(&m, &keep, sizeof m);
  ck_assert_int_eq(dt_mesh_init(&m, 1 << 15, 1 << 15, 1, 1), 0);
  ck_assert_int_eq(dt_mesh_world(&m), 1 << 30);
  dt_mesh_t bad = {.pp = 1, .dp = 0, .cp = 1, .tp = 1};
  ck_assert_int_eq(dt_mesh_world(&bad), DT_EINVAL);
}
END_TEST

START_TEST(test_names_and_format)
{
  ck_assert_str_eq(dt_mesh_axis_name(DT_MESH_PP), "pp");
  ck_assert_str_eq(dt_mesh_axis_name(DT_MESH_DP), "dp");
  ck_assert_str_eq(dt_mesh_axis_name(DT_MESH_CP), "cp");
  ck_assert_str_eq(dt_mesh_axis_name(DT_MESH_TP), "tp");
  ck_assert_str_eq(dt_mesh_axis_name(DT_MESH_NAXES), "?");
  dt_mesh_t m = {.pp = 1, .dp = 8, .cp = 1, .tp = 1};
  char buf[64];
  dt_mesh_format(&m, buf, sizeof buf);
  ck_assert_str_eq(buf, "pp 1 x dp 8 x cp 1 x tp 1");
  dt_mesh_format(&m, buf, 5);
  ck_assert_str_eq(buf, "pp 1");
}
END_TEST

/* Hand-computed ranks of the 2x2x1x2 mesh (pp, dp, cp, tp), the example of ARCHITECTURE.md. */
START_TEST(test_known_ranks_2x2x1x2)
{
  dt_mesh_t m = {.pp = 2, .dp = 2, .cp = 1, .tp = 2};
  static const int want[8][4] = {
      {0, 0, 0, 0}, {0, 0, 0, 1}, {0, 1, 0, 0}, {0, 1, 0, 1},
      {1, 0, 0, 0}, {1, 0, 0, 1}, {1, 1, 0, 0}, {1, 1, 0, 1},
  };
  for (int r = 0; r < 8; r++) {
    dt_mesh_coord_t c;
    ck_assert_int_eq(dt_mesh_coords(&m, r, &c), 0);
    ck_assert_int_eq(c.pp, want[r][0]);
    ck_assert_int_eq(c.dp, want[r][1]);
    ck_assert_int_eq(c.cp, want[r][2]);
    ck_assert_int_eq(c.tp, want[r][3]);
    ck_assert_int_eq(dt_mesh_rank(&m, &c), r);
  }
}
END_TEST

/* Every rank of every mesh: coords obey the formula, the inverse gives the rank back, and the
 * map is a bijection onto the whole coordinate box. */
START_TEST(test_all_ranks_roundtrip)
{
  for (size_t i = 0; i < sizeof g_meshes / sizeof g_meshes[0]; i++) {
    dt_mesh_t m = mesh_of(g_meshes[i]);
    int world = dt_mesh_world(&m);
    ck_assert_int_eq(world, m.pp * m.dp * m.cp * m.tp);
    char *hit = calloc((size_t)world, 1);
    for (int r = 0; r < world; r++) {
      dt_mesh_coord_t c;
      ck_assert_int_eq(dt_mesh_coords(&m, r, &c), 0);
      ck_assert(c.pp >= 0 && c.pp < m.pp && c.dp >= 0 && c.dp < m.dp);
      ck_assert(c.cp >= 0 && c.cp < m.cp && c.tp >= 0 && c.tp < m.tp);
      ck_assert_int_eq(((c.pp * m.dp + c.dp) * m.cp + c.cp) * m.tp + c.tp, r);
      ck_assert_int_eq(dt_mesh_rank(&m, &c), r);
    }
    /* And from the coordinate side: every box point maps to a distinct rank. */
    for (int a = 0; a < m.pp; a++)
      for (int b = 0; b < m.dp; b++)
        for (int c = 0; c < m.cp; c++)
          for (int d = 0; d < m.tp; d++) {
            dt_mesh_coord_t co = {.pp = a, .dp = b, .cp = c, .tp = d};
            int r = dt_mesh_rank(&m, &co);
            ck_assert(r >= 0 && r < world);
            ck_assert_int_eq(hit[r], 0);
            hit[r] = 1;
          }
    for (int r = 0; r < world; r++)
      ck_assert_int_eq(hit[r], 1);
    free(hit);
  }
}
END_TEST

START_TEST(test_out_of_range)
{
  dt_mesh_t m = {.pp = 2, .dp = 2, .cp = 1, .tp = 2};
  dt_mesh_coord_t c = {0};
  ck_assert_int_eq(dt_mesh_coords(&m, -1, &c), DT_ERANGE);
  ck_assert_int_eq(dt_mesh_coords(&m, 8, &c), DT_ERANGE);
  const dt_mesh_coord_t bad[] = {
      {.pp = 2}, {.dp = 2}, {.cp = 1}, {.tp = 2}, {.pp = -1}, {.tp = -1},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_int_eq(dt_mesh_rank(&m, &bad[i]), DT_ERANGE);
  dt_mesh_t invalid = {.pp = 0, .dp = 1, .cp = 1, .tp = 1};
  ck_assert_int_eq(dt_mesh_coords(&invalid, 0, &c), DT_EINVAL);
  ck_assert_int_eq(dt_mesh_rank(&invalid, &c), DT_EINVAL);
}
END_TEST

START_TEST(test_groups)
{
  dt_mesh_t m = {.pp = 2, .dp = 2, .cp = 1, .tp = 2};
  int g[8];
  ck_assert_int_eq(dt_mesh_group(&m, 5, DT_MESH_TP, g), 2);
  ck_assert_int_eq(g[0], 4);
  ck_assert_int_eq(g[1], 5);
  ck_assert_int_eq(dt_mesh_group(&m, 5, DT_MESH_DP, g), 2);
  ck_assert_int_eq(g[0], 5);
  ck_assert_int_eq(g[1], 7);
  ck_assert_int_eq(dt_mesh_group(&m, 5, DT_MESH_PP, g), 2);
  ck_assert_int_eq(g[0], 1);
  ck_assert_int_eq(g[1], 5);
  ck_assert_int_eq(dt_mesh_group(&m, 5, DT_MESH_CP, g), 1);
  ck_assert_int_eq(g[0], 5);
  ck_assert_int_eq(dt_mesh_group(&m, 8, DT_MESH_TP, g), DT_ERANGE);
  ck_assert_int_eq(dt_mesh_group(&m, 0, DT_MESH_NAXES, g), DT_EINVAL);

  /* On every mesh, the groups along an axis partition the world, and a group's members differ
   * from rank only in that axis' coordinate. */
  for (size_t i = 0; i < sizeof g_meshes / sizeof g_meshes[0]; i++) {
    dt_mesh_t mm = mesh_of(g_meshes[i]);
    int world = dt_mesh_world(&mm);
    int *grp = malloc((size_t)world * sizeof *grp);
    for (int axis = 0; axis < DT_MESH_NAXES; axis++)
      for (int r = 0; r < world; r++) {
        int n = dt_mesh_group(&mm, r, (dt_mesh_axis_t)axis, grp);
        ck_assert_int_eq(n, dt_mesh_axis_size(&mm, (dt_mesh_axis_t)axis));
        dt_mesh_coord_t cr, cp;
        dt_mesh_coords(&mm, r, &cr);
        int found = 0;
        for (int k = 0; k < n; k++) {
          dt_mesh_coords(&mm, grp[k], &cp);
          int a[4] = {cr.pp - cp.pp, cr.dp - cp.dp, cr.cp - cp.cp, cr.tp - cp.tp};
          for (int j = 0; j < 4; j++)
            if (j != axis)
              ck_assert_int_eq(a[j], 0);
          const int pos[4] = {cp.pp, cp.dp, cp.cp, cp.tp};
          ck_assert_int_eq(pos[axis], k); /* in axis order */
          found += grp[k] == r;
        }
        ck_assert_int_eq(found, 1);
      }
    free(grp);
  }
}
END_TEST

/* ------------------------------------------------------------------------------------------ */
/* Placement                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* The invariants every placement must keep, whatever the nodes. */
static void check_placement(const dt_placement_t *p, const int *devs, int nnodes)
{
  ck_assert_int_eq(p->world, dt_mesh_world(&p->mesh));
  ck_assert_int_eq(p->nnodes, nnodes);
  int used = 0, total = 0;
  for (int i = 0; i < nnodes; i++) {
    ck_assert(p->node_nranks[i] >= 0 && p->node_nranks[i] <= devs[i]);
    ck_assert_int_eq(p->node_nranks[i] % p->mesh.tp, 0);
    ck_assert_int_eq(p->node_first[i] < 0, p->node_nranks[i] == 0);
    used += p->node_nranks[i] > 0;
    total += p->node_nranks[i];
  }
  ck_assert_int_eq(used, p->nodes_used);
  ck_assert_int_eq(total, p->world);
  for (int r = 0; r < p->world; r++) {
    const dt_rank_place_t *x = &p->ranks[r];
    ck_assert_int_eq(x->rank, r);
    ck_assert(x->node >= 0 && x->node < nnodes);
    ck_assert_int_eq(x->local_rank, r - p->node_first[x->node]);
    ck_assert(x->local_rank < p->node_nranks[x->node]);
    ck_assert_int_eq(x->device, x->local_rank);
    ck_assert(x->device < devs[x->node]);
    dt_mesh_coord_t c;
    ck_assert_int_eq(dt_mesh_coords(&p->mesh, r, &c), 0);
    ck_assert_mem_eq(&c, &x->coord, sizeof c);
    /* A tensor-parallel group never spans nodes. */
    ck_assert_int_eq(x->node, p->ranks[r - x->coord.tp].node);
    /* Nodes are filled in list order. */
    if (r > 0)
      ck_assert(p->ranks[r - 1].node <= x->node);
  }
}

START_TEST(test_place_uneven_nodes)
{
  /* world 6 = dp 3 x tp 2 on nodes with 3, 2 and 4 devices: node 0 gives 2 (its third device
   * cannot hold a whole tp group), node 1 gives 2, node 2 gives 2 of its 4. */
  dt_mesh_t m = {.pp = 1, .dp = 3, .cp = 1, .tp = 2};
  const int devs[] = {3, 2, 4};
  dt_placement_t p;
  char why[256];
  ck_assert_int_eq(dt_mesh_place(&m, devs, 3, &p, why, sizeof why), 0);
  ck_assert_str_eq(why, "");
  check_placement(&p, devs, 3);
  ck_assert_int_eq(p.world, 6);
  ck_assert_int_eq(p.nodes_used, 3);
  static const int node[6] = {0, 0, 1, 1, 2, 2}, local[6] = {0, 1, 0, 1, 0, 1};
  for (int r = 0; r < 6; r++) {
    ck_assert_int_eq(p.ranks[r].node, node[r]);
    ck_assert_int_eq(p.ranks[r].local_rank, local[r]);
    ck_assert_int_eq(p.ranks[r].device, local[r]);
    ck_assert_int_eq(p.ranks[r].coord.dp, r / 2);
    ck_assert_int_eq(p.ranks[r].coord.tp, r % 2);
  }
  ck_assert_int_eq(p.node_first[0], 0);
  ck_assert_int_eq(p.node_first[1], 2);
  ck_assert_int_eq(p.node_first[2], 4);
  ck_assert_int_eq(p.node_nranks[2], 2);
  dt_placement_free(&p);
  ck_assert_ptr_null(p.ranks);
}
END_TEST

START_TEST(test_place_skips_small_node)
{
  /* tp 4: the 1-device node cannot hold a group and is skipped; the others take 4 each. */
  dt_mesh_t m = {.pp = 2, .dp = 1, .cp = 1, .tp = 4};
  const int devs[] = {1, 4, 6};
  dt_placement_t p;
  char why[256];
  ck_assert_int_eq(dt_mesh_place(&m, devs, 3, &p, why, sizeof why), 0);
  check_placement(&p, devs, 3);
  ck_assert_int_eq(p.nodes_used, 2);
  ck_assert_int_eq(p.node_nranks[0], 0);
  ck_assert_int_eq(p.node_first[0], -1);
  ck_assert_int_eq(p.node_first[1], 0);
  ck_assert_int_eq(p.node_nranks[1], 4);
  ck_assert_int_eq(p.node_first[2], 4);
  ck_assert_int_eq(p.node_nranks[2], 4);
  for (int r = 0; r < 8; r++) {
    ck_assert_int_eq(p.ranks[r].node, r < 4 ? 1 : 2);
    ck_assert_int_eq(p.ranks[r].coord.pp, r / 4); /* one pipeline stage per node */
  }
  dt_placement_free(&p);
}
END_TEST

START_TEST(test_place_leaves_spare_nodes)
{
  dt_mesh_t m = {.pp = 1, .dp = 4, .cp = 1, .tp = 1};
  const int devs[] = {8, 8, 8};
  dt_placement_t p;
  char why[256];
  ck_assert_int_eq(dt_mesh_place(&m, devs, 3, &p, why, sizeof why), 0);
  check_placement(&p, devs, 3);
  ck_assert_int_eq(p.nodes_used, 1);
  ck_assert_int_eq(p.node_nranks[0], 4);
  ck_assert_int_eq(p.node_nranks[1], 0);
  ck_assert_int_eq(p.node_first[2], -1);
  dt_placement_free(&p);

  /* Nodes with no devices at all are fine, just unused. */
  const int devs2[] = {0, 2, 0, 3};
  dt_mesh_t m2 = {.pp = 1, .dp = 5, .cp = 1, .tp = 1};
  ck_assert_int_eq(dt_mesh_place(&m2, devs2, 4, &p, why, sizeof why), 0);
  check_placement(&p, devs2, 4);
  ck_assert_int_eq(p.nodes_used, 2);
  ck_assert_int_eq(p.ranks[4].node, 3);
  ck_assert_int_eq(p.ranks[4].local_rank, 2);
  dt_placement_free(&p);
}
END_TEST

/* A sweep of meshes over node lists: whenever placement succeeds the invariants hold, and it
 * fails exactly when the usable devices (whole tp groups per node) are too few. */
START_TEST(test_place_sweep)
{
  static const int lists[][5] = {
      {1, 1, 1, 1, 1}, {2, 2, 2, 2, 2}, {8, 0, 8, 0, 8}, {3, 5, 7, 2, 1}, {4, 4, 4, 4, 4},
  };
  for (size_t i = 0; i < sizeof g_meshes / sizeof g_meshes[0]; i++)
    for (size_t l = 0; l < sizeof lists / sizeof lists[0]; l++) {
      dt_mesh_t m = mesh_of(g_meshes[i]);
      int usable = 0, largest = 0;
      for (int n = 0; n < 5; n++) {
        usable += lists[l][n] / m.tp * m.tp;
        largest = lists[l][n] > largest ? lists[l][n] : largest;
      }
      dt_placement_t p;
      char why[256];
      int rc = dt_mesh_place(&m, lists[l], 5, &p, why, sizeof why);
      if (usable >= dt_mesh_world(&m) && largest >= m.tp) {
        ck_assert_msg(rc == 0, "mesh %zu list %zu: %s", i, l, why);
        check_placement(&p, lists[l], 5);
      } else {
        ck_assert_int_eq(rc, DT_EUNAVAIL);
        ck_assert_ptr_null(p.ranks);
        ck_assert(strlen(why) > 0);
      }
      dt_placement_free(&p);
    }
}
END_TEST

START_TEST(test_place_errors)
{
  dt_placement_t p;
  char why[256];

  dt_mesh_t tp4 = {.pp = 1, .dp = 1, .cp = 1, .tp = 4};
  const int small[] = {2, 2, 1};
  ck_assert_int_eq(dt_mesh_place(&tp4, small, 3, &p, why, sizeof why), DT_EUNAVAIL);
  ck_assert_str_eq(why, "tp=4 needs 4 devices on one node; the largest node has 2");
  ck_assert_ptr_null(p.ranks);
  ck_assert_ptr_null(p.node_nranks);
  dt_placement_free(&p);

  dt_mesh_t dp8 = {.pp = 1, .dp = 8, .cp = 1, .tp = 1};
  const int three[] = {2, 2, 2};
  ck_assert_int_eq(dt_mesh_place(&dp8, three, 3, &p, why, sizeof why), DT_EUNAVAIL);
  ck_assert_str_eq(why, "world 8 (pp 1 x dp 8 x cp 1 x tp 1) needs 8 devices, 3 nodes offer 6");

  const int one[] = {2};
  ck_assert_int_eq(dt_mesh_place(&dp8, one, 1, &p, why, sizeof why), DT_EUNAVAIL);
  ck_assert_str_eq(why, "world 8 (pp 1 x dp 8 x cp 1 x tp 1) needs 8 devices, 1 node offers 2");

  /* Enough devices in total, but not in whole tensor-parallel groups. */
  dt_mesh_t tp2 = {.pp = 1, .dp = 3, .cp = 1, .tp = 2};
  const int odd[] = {3, 3};
  ck_assert_int_eq(dt_mesh_place(&tp2, odd, 2, &p, why, sizeof why), DT_EUNAVAIL);
  ck_assert_str_eq(why, "world 6 (pp 1 x dp 3 x cp 1 x tp 2) needs 6 devices, 2 nodes offer 4 "
                        "(6 devices, but tensor-parallel groups of 2 cannot span nodes)");

  dt_mesh_t single = {.pp = 1, .dp = 1, .cp = 1, .tp = 1};
  ck_assert_int_eq(dt_mesh_place(&single, NULL, 0, &p, why, sizeof why), DT_EUNAVAIL);
  ck_assert_str_eq(why, "world 1 (pp 1 x dp 1 x cp 1 x tp 1) needs 1 device, 0 nodes offer 0");

  const int negative[] = {2, -1};
  ck_assert_int_eq(dt_mesh_place(&single, negative, 2, &p, why, sizeof why), DT_EINVAL);
  ck_assert_str_eq(why, "node 1 reports -1 devices");

  dt_mesh_t invalid = {.pp = 1, .dp = 0, .cp = 1, .tp = 1};
  ck_assert_int_eq(dt_mesh_place(&invalid, three, 3, &p, why, sizeof why), DT_EINVAL);
  ck_assert_ptr_nonnull(strstr(why, "invalid mesh"));
  ck_assert_int_eq(dt_mesh_place(&single, NULL, 2, &p, why, sizeof why), DT_EINVAL);
  /* A short why buffer is still NUL-terminated. */
  ck_assert_int_eq(dt_mesh_place(&dp8, three, 3, &p, why, 8), DT_EUNAVAIL);
  ck_assert_str_eq(why, "world 8");
}
END_TEST

/* ------------------------------------------------------------------------------------------ */

static Suite *mesh_suite(void)
{
  Suite *s = suite_create("mesh");
  TCase *t = tcase_create("arithmetic");
  tcase_add_test(t, test_init_and_world);
  tcase_add_test(t, test_names_and_format);
  tcase_add_test(t, test_known_ranks_2x2x1x2);
  tcase_add_test(t, test_all_ranks_roundtrip);
  tcase_add_test(t, test_out_of_range);
  tcase_add_test(t, test_groups);
  suite_add_tcase(s, t);

  t = tcase_create("placement");
  tcase_add_test(t, test_place_uneven_nodes);
  tcase_add_test(t, test_place_skips_small_node);
  tcase_add_test(t, test_place_leaves_spare_nodes);
  tcase_add_test(t, test_place_sweep);
  tcase_add_test(t, test_place_errors);
  suite_add_tcase(s, t);
  return s;
}

int main(void)
{
  SRunner *sr = srunner_create(mesh_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
