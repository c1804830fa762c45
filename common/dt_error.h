/* dt_error.h — distrain's one error type.
 *
 * Every action returns int: 0 on success or a negative DT_E* code from the X-macro table
 * below, which also generates dt_strerror() and dt_err_name() (the libuv pattern). Foreign
 * errors (errno, CUDA, NCCL, gRPC) are converted at the boundary by the check macros in
 * dt_log.h, which log file:line with the foreign message. */
#ifndef DT_ERROR_H
#define DT_ERROR_H

/* name, value, message */
#define DT_ERRNO_MAP(X)                                                                            \
  X(EINVAL, -1, "invalid argument")                                                                \
  X(ENOMEM, -2, "out of memory")                                                                   \
  X(EIO, -3, "input/output error")                                                                 \
  X(ENOENT, -4, "no such file or directory")                                                       \
  X(EFORMAT, -5, "bad file format (magic, version or size)")                                       \
  X(ESHAPE, -6, "shape mismatch")                                                                  \
  X(ERANGE, -7, "value out of range")                                                              \
  X(EEXIST, -8, "already exists")                                                                  \
  X(EACCES, -9, "permission denied")                                                               \
  X(ENAN, -10, "non-finite value (NaN or Inf)")                                                    \
  X(ETIMEDOUT, -11, "operation timed out")                                                         \
  X(EREMOTE, -12, "remote peer failed")                                                            \
  X(ESTALE, -13, "stale generation")                                                               \
  X(ECANCELED, -14, "operation canceled")                                                          \
  X(EUNAVAIL, -15, "service unavailable")                                                          \
  X(EAUTH, -16, "authentication failed")                                                           \
  X(ENOTSUP, -17, "not supported")                                                                 \
  X(ECUDA, -18, "CUDA error")                                                                      \
  X(ENCCL, -19, "NCCL error")                                                                      \
  X(ERPC, -20, "RPC error")                                                                        \
  X(ESYS, -21, "system call failed")                                                               \
  X(EINTERNAL, -22, "internal error")                                                              \
  X(EBUSY, -23, "resource exhausted, try again later")                                             \
  X(ESPIKE, -24, "loss or gradient-norm spike (--spike-factor, --grad-spike-factor)")              \
  X(ENOSPC, -25, "no space left on device (or disk quota exceeded)")

typedef enum {
#define DT__ERR_ENUM(name, val, msg) DT_##name = (val),
  DT_ERRNO_MAP(DT__ERR_ENUM)
#undef DT__ERR_ENUM
} dt_errno_t;

/* A human message for an error code ("unknown error" for codes outside the table). */
const char *dt_strerror(int err);
/* The symbolic name ("DT_EFORMAT"). */
const char *dt_err_name(int err);
/* Converts a positive errno value to the closest DT_E* code. */
int dt_err_from_errno(int errnum);

#endif
