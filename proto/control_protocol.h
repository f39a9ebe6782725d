/* The version of the control protocol (proto/strata_internal.proto, Join.protocol_version) that
 * this build speaks: the one definition both ends use (coordinator/control/control_server.h as
 * CTL_PROTOCOL_VERSION, worker/control/control_client.h as CTL_CLIENT_PROTOCOL_VERSION). Raise
 * it when a change to strata_internal.proto or to the message order breaks workers of the
 * previous version; the coordinator refuses a Join of another version with FAILED_PRECONDITION. */
#ifndef STRATA_PROTO_CONTROL_PROTOCOL_H
#define STRATA_PROTO_CONTROL_PROTOCOL_H

#define PROTO_CONTROL_PROTOCOL_VERSION 3u   /* 2: prefix caching; 3: the secret proved, not sent */

/* The cluster secret's length in bytes (what Join.secret_proof proves; a file's trailing newline is not part of
 * it): the coordinator refuses a Join outside this range, and both programs refuse such a file. */
#define PROTO_SECRET_MIN_BYTES 16
#define PROTO_SECRET_MAX_BYTES 256

#endif
