/* rpc_grpc.h — what rpc.c (gRPC's set-up, TLS, the client) shares with rpc_server.c. Not part
 * of the API: include rpc.h. */
#ifndef DT_RPC_GRPC_H
#define DT_RPC_GRPC_H

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>

/* Initializes gRPC once per process. accept_failed (NULL: keep the one set) is called, from
 * any thread, on gRPC's log line saying its own listener stopped accepting for good. */
void dt__rpc_init(void (*accept_failed)(void));
/* Loads the TLS configuration once (rpc.h, "TLS"); 0, or DT_EINVAL when it is unusable. */
int dt__rpc_tls_config(void);
/* The server's credentials (TLS when configured, mutual with a CA) and channel arguments. */
grpc_server_credentials *dt__rpc_server_creds(void);
grpc_channel_args *dt__rpc_server_args(void);

#endif
