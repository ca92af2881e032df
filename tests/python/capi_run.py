"""python.capi: capi_check (tests/python/capi_check.c) against 2 servers of
the binding's job, so that the build's own flags (ASan in a sanitized build)
check the C API's memory."""
import subprocess
import sys

from common import LocalCluster, flat_job, say

with LocalCluster(flat_job("py-capi"), servers=2) as c:
    say(f"servers {c.servers}")
    rc = subprocess.call([sys.argv[1], c.servers], timeout=90)
    for s in range(2):
        c.procs[s].poll()
    check_log = [c.log_tail(s, 3) for s in range(2)]
if rc != 0:
    print("server logs:", *check_log, sep="\n")
sys.exit(rc)
