/* stop.h — a request from outside to stop training (SIGTERM), honoured at a step boundary with
 * a checkpoint.
 *
 * What a scheduler sends before it takes the machine back (Slurm's preemption and time limit,
 * systemd's stop, a spot instance's reclaim, the agent when a user stops the job) is SIGTERM,
 * followed after a grace period by SIGKILL. The trainer finishes the step it is in; every rank
 * learns of the request in the same step (the training loop all-reduces the flag over the world
 * once a step, whichever ranks got the signal); all of them save a checkpoint of that step,
 * wait until it is committed and exit with DT_TRAIN_EXIT_STOPPED (jobspec.h). Another SIGTERM,
 * 2 s or more after the first, ends the process at once (a rank blocked in a collective whose
 * peer is gone cannot reach the step's end); those sooner are the same request, delivered twice.
 * SIGINT (Ctrl-C) keeps its default action. */
#ifndef DT_TRAINER_STOP_H
#define DT_TRAINER_STOP_H

/* Blocks SIGTERM in the calling thread, and so in every thread it creates after this call (no
 * system call of theirs is interrupted), and starts the thread that waits for it. Call it first
 * in main, before any other thread exists. */
int dt_stop_watch(void);
/* SIGTERM once one has been received, else 0. */
int dt_stop_requested(void);

#endif
