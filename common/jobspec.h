/* jobspec.h — job specs: defaults, YAML files, --set overrides, static validation, YAML output
 * and the distrain-train command line of one rank.
 *
 * A job spec is the wire message Distrain__V1__JobSpec itself (proto/distrain.proto); there is no
 * second C struct to keep in sync. The YAML schema is the message's own shape, read from the
 * protobuf-c descriptors: the top-level keys are JobSpec's fields (`name` and the sections
 * model, data, training, optimizer, parallel, checkpoint, elastic) and each section's keys are
 * its message's fields, with the proto field names. Adding a field to the .proto adds it to the
 * YAML schema, to --set and to the YAML output.
 *
 * Typing is strict: int32 fields take plain decimal integers that fit 32 bits, double fields
 * take plain decimal numbers ("3e-4", "1.0e-8", "2"), bool fields take true/false, string fields
 * take any scalar (a plain empty/~/null value is the empty string). A quoted "4" is a string,
 * not an integer, as YAML says. Every error names the origin, the 1-based line and the key:
 *   job.yaml:3: model.layers: expected an integer, got 'four'
 *
 * Ownership: specs from dt_jobspec_new_default() (or protobuf-c's unpack) are freed with
 * dt_jobspec_free(). Every non-empty string in a spec is on the heap; empty strings are
 * protobuf-c's static protobuf_c_empty_string, which protobuf_c_message_free_unpacked skips.
 * So a spec that came off the wire can be modified with these functions and freed the same way. */
#ifndef DT_JOBSPEC_H
#define DT_JOBSPEC_H

#include <stdbool.h>
#include <stddef.h>

#include "distrain.pb-c.h"
#include "mesh.h"

/* A fresh spec with every section present and the defaults filled in (see jobspec.c for the
 * values; they mirror deploy/jobs/example.yaml, with data.train empty). 0 or DT_ENOMEM. */
int dt_jobspec_new_default(Distrain__V1__JobSpec **out);
void dt_jobspec_free(Distrain__V1__JobSpec *spec);

/* Applies one YAML document on top of spec: keys present in the text replace the values in
 * spec, everything else stays (so defaults + file). A section missing from spec is created
 * zeroed when the text names it. origin names the text in messages (a path; NULL: "<string>").
 * All or nothing: on error spec is unchanged, err holds one line and the return is DT_EINVAL
 * (bad schema, types or syntax) or DT_ENOMEM. An empty document changes nothing. */
int dt_jobspec_parse_yaml(const char *text, size_t len, const char *origin,
                          Distrain__V1__JobSpec *spec, char *err, size_t errlen);
/* dt_jobspec_parse_yaml on a file's contents (origin = path). Unreadable files give the errno
 * code (DT_ENOENT, DT_EACCES, ...) with the reason in err. */
int dt_jobspec_parse_file(const char *path, Distrain__V1__JobSpec *spec, char *err, size_t errlen);

/* Applies one "section.key=value" override (distrainctl --set), typed like the YAML scalar
 * `value` would be, except that a string takes value literally ("" and "null" included).
 * Top-level scalars have no section ("name=run7"). Errors start with "--set ASSIGNMENT: " and
 * leave the value unchanged. */
int dt_jobspec_set(Distrain__V1__JobSpec *spec, const char *assignment, char *err, size_t errlen);

/* Static rules (no cluster knowledge): sizes positive, mesh divides the model and the batch,
 * known schedules, data present, sane optimizer and elastic settings. Every violated rule is
 * reported, each naming the rule and the values, joined by "; " in err. 0 or DT_EINVAL.
 * Mesh shapes the trainer cannot run yet (tp, pp, cp > 1) pass: that is the trainer's call. */
int dt_jobspec_validate(const Distrain__V1__JobSpec *spec, char *err, size_t errlen);

/* The whole spec as a YAML document (libyaml's emitter; block style, strings double-quoted,
 * doubles in the shortest form that reads back exactly). *out is malloc'ed and NUL-terminated.
 * dt_jobspec_parse_yaml of the result onto any spec with all sections gives an equal spec. */
int dt_jobspec_to_yaml(const Distrain__V1__JobSpec *spec, char **out);

/* Field-by-field equality (through the canonical wire encoding). A predicate: true/false. */
bool dt_jobspec_equal(const Distrain__V1__JobSpec *a, const Distrain__V1__JobSpec *b);

/* The spec's mesh (pp, dp, cp, tp from the parallel section). 0 or DT_EINVAL. */
int dt_jobspec_mesh(const Distrain__V1__JobSpec *spec, dt_mesh_t *mesh);

/* Gradient-accumulation steps that keep the global batch when dp_size ranks share it:
 * training.batch / (training.micro_batch * dp_size). Returns it (>= 1), or DT_EINVAL when
 * dp_size < 1, it does not divide evenly, or the interleaved pipeline schedule would get a
 * count that is not a multiple of pp: the re-planner uses this to pick a dp that works, so a
 * job that shrinks after losing a node never gets a layout its trainers refuse. */
int dt_jobspec_grad_accum(const Distrain__V1__JobSpec *spec, int dp_size);

/* Places the job on nnodes nodes of node_devices[i] devices each: the largest dp in
 * [min_dp, max_dp] with a whole gradient accumulation (dt_jobspec_grad_accum) whose mesh (the
 * spec's pp, cp and tp at that dp) fits (dt_mesh_place). Returns that dp with its placement in
 * *pl (free with dt_placement_free), or DT_EUNAVAIL with why saying why the largest candidate
 * did not fit (DT_EINVAL for an invalid mesh). The coordinator plans with this, and
 * `distrainctl run --local` checks with it that its cluster can ever hold the job. */
int dt_jobspec_place(const Distrain__V1__JobSpec *spec, int min_dp, int max_dp,
                     const int *node_devices, int nnodes, dt_placement_t *pl, char *why,
                     size_t whylen);

/* distrain-train's exit statuses besides 0 (done) and 1 (failed): 2, its flags or input refused
 * (a restart would fail the same way); 3, stopped on request (SIGTERM) after a step
 * that every rank stopped after and whose checkpoint is committed (worker/trainer/stop.h). */
#define DT_TRAIN_EXIT_INPUT   2
#define DT_TRAIN_EXIT_STOPPED 3

/* The most batches a loss spike's rollback skips (elastic.spike_skip, --spike-skip), and steps
 * one --skip-steps list holds. */
#define DT_SPIKE_SKIP_MAX 10000
#define DT_SKIP_STEPS_MAX 1000000

/* distrain-train's arguments for one rank of this job (argv[0] not included), NULL-terminated,
 * every string malloc'ed; free with dt_argv_free. dp_size is the data-parallel size of the
 * current generation (it may differ from parallel.dp after an elastic re-plan: the global batch
 * is kept through --grad-accum). resume != 0 adds --resume (newest committed step in
 * checkpoint.dir). model.init maps to: "seed:N" -> --init seed:N; "llmc:PATH" and "hf:DIR" ->
 * --init the same (left out on resume: the weights come from the checkpoint); any other value is a
 * distrain checkpoint to start from -> --resume=PATH (plain --resume on resume). Numbers are
 * printed so that they parse back to exactly the same value. DT_EINVAL (indivisible batch,
 * missing section) or DT_ENOMEM. */
int dt_jobspec_trainer_argv(const Distrain__V1__JobSpec *spec, int dp_size, int resume,
                            char ***argv_out, int *argc_out);
/* Frees a NULL-terminated argv whose strings and array are malloc'ed; NULL is allowed. */
void dt_argv_free(char **argv);

#endif
