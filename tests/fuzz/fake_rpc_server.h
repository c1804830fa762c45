/* fake_rpc_server.h — the server half of rpc.h without gRPC, for fuzz_coord: linked in place of
 * common/rpc_server.c, it keeps the handlers dt_rpc_server_handle registers and calls them
 * directly with a request the harness decoded (one with a string that is not UTF-8 is refused
 * first, as the real server refuses it). Replies are checked, not sent: an answer must be a
 * message any client can decode (protobuf_c_message_check, every string UTF-8, then a
 * pack/unpack round trip) of the method's output type; a failure must carry a gRPC error status and
 * a reason; a call is answered at most once, never after its client went away (the fake frees it
 * then, so AddressSanitizer reports a late use), and a call kept past its handler has a cancel
 * callback (otherwise the coordinator could never forget it). Any violation aborts (fuzz.h). */
#ifndef DT_TESTS_FAKE_RPC_SERVER_H
#define DT_TESTS_FAKE_RPC_SERVER_H

#include <stdint.h>

#include "rpc.h"

/* The server dt_rpc_server_create made last (the coordinator's), or NULL. */
dt_rpc_server_t *fake_rpc_server(void);
/* Runs method (an index into the service's methods) with req, of its input type, as a call
 * whose client waits deadline_ms. Returns the call's status if answered during the handler,
 * -1 if the handler kept it. */
int fake_rpc_call(dt_rpc_server_t *s, unsigned method, const ProtobufCMessage *req,
                  int64_t deadline_ms);
/* Calls kept by handlers and not answered yet. */
size_t fake_rpc_held(const dt_rpc_server_t *s);
/* The client of the i-th held call (oldest first) goes away: its cancel callback runs. */
void fake_rpc_cancel(dt_rpc_server_t *s, size_t i);
/* Frees the calls answered since the last sweep (kept until then, as gRPC keeps a call until
 * its completions come back to the loop). */
void fake_rpc_sweep(dt_rpc_server_t *s);

#endif
