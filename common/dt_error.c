/* dt_error.c — the strings behind DT_ERRNO_MAP. */
#include "dt_error.h"

#include <errno.h>

const char *dt_strerror(int err)
{
  switch (err) {
  case 0:
    return "success";
#define DT__ERR_MSG(name, val, msg)                                                                \
  case DT_##name:                                                                                  \
    return msg;
    DT_ERRNO_MAP(DT__ERR_MSG)
#undef DT__ERR_MSG
  default:
    return "unknown error";
  }
}

const char *dt_err_name(int err)
{
  switch (err) {
  case 0:
    return "OK";
#define DT__ERR_NAME(name, val, msg)                                                               \
  case DT_##name:                                                                                  \
    return "DT_" #name;
    DT_ERRNO_MAP(DT__ERR_NAME)
#undef DT__ERR_NAME
  default:
    return "DT_UNKNOWN";
  }
}

int dt_err_from_errno(int errnum)
{
  switch (errnum) {
  case 0:
    return 0;
  case ENOENT:
  case ENOTDIR:
    return DT_ENOENT;
  case EACCES:
  case EPERM:
  case EROFS:
    return DT_EACCES;
  case ENOMEM:
    return DT_ENOMEM;
  case EEXIST:
    return DT_EEXIST;
  case EINVAL:
    return DT_EINVAL;
  case ETIMEDOUT:
    return DT_ETIMEDOUT;
  case ERANGE:
    return DT_ERANGE;
  case ECANCELED:
    return DT_ECANCELED;
  case ENOSPC:
  case EDQUOT:
    return DT_ENOSPC;
  case EIO:
    return DT_EIO;
  default:
    return DT_ESYS;
  }
}
