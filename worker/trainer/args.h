/* args.h — distrain-train's command line (its --help lists the flags): flags into the options
 * dt_train_run takes. The coordinator builds these flags from a job spec
 * (dt_jobspec_trainer_argv), so whatever a spec that validates turns into must parse here and
 * pass dt_train_opts_validate: tests/fuzz's job spec target checks that. */
#ifndef DT_TRAINER_ARGS_H
#define DT_TRAINER_ARGS_H

#include "trainer.h"

/* Parses argv (argv[0] is the program) into o, which holds the defaults
 * (dt_train_opts_default) or earlier flags. 0; 1 after printing the usage for --help; DT_EINVAL
 * after printing what is wrong on stderr. Strings in o point into argv; the --skip-steps list is
 * allocated (dt_train_args_free). DISTRAIN_PROFILE and DISTRAIN_PROFILE_TRACE stand in for
 * --profile and --profile-trace. */
int dt_train_parse_args(int argc, char **argv, dt_train_opts_t *o);
/* Frees what dt_train_parse_args allocated in o. */
void dt_train_args_free(dt_train_opts_t *o);

#endif
