/* The `ps-server --status` client: every shard's Status at once, as JSON
 * or as the --watch table. It speaks to the servers over the service
 * (proto/ps.proto) like any client, and calls nothing of the server's
 * parts: it lives with the program that runs it. */
#ifndef PS_PS_MAIN_STATUS_CLI_H
#define PS_PS_MAIN_STATUS_CLI_H

#include "common/security.h"

/* Asks the shards at list (addresses, comma-separated, as --ps takes them)
 * for their Status, all at once, and prints it on stdout as JSON: for one
 * address its object, for several an array of them in the list's order
 * ({"address", "error"} in place of a shard that did not answer). Returns
 * the process's exit code: 0; 1 with a message on stderr when a shard did
 * not answer within timeout_ms, answered an error status or a malformed
 * reply; 2 for a bad list or security flag. */
int ps_status_print(const char *list, const ps_security_opts *sec, int timeout_ms);

/* --status LIST --watch: every interval_s, a table of the shards (version,
 * pushes and pulls per second between two refreshes, staleness, workers,
 * waiting pulls, checkpoint set, uptime; the address and the error for one
 * that does not answer) and of the workers shard 0 lists. At a terminal each
 * refresh clears the screen and fits it; elsewhere each is a block of lines
 * ending with a blank line. Stops on SIGINT or SIGTERM, or after count
 * refreshes (count > 0); returns 0 then, 2 for a bad list or security flag,
 * 1 when the client cannot be set up. Leaves SIGINT and SIGTERM blocked:
 * the process exits after it. */
int ps_status_watch(const char *list, const ps_security_opts *sec, double interval_s, int count);


#endif
