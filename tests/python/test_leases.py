"""python.leases: a Python worker killed (SIGKILL: no Leave) while holding
two leased chunks; the shards drop it after the job's heartbeat timeout and
hand its chunks out again, and another Python worker, which waited idle for
them, trains every example of the epoch exactly once."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from common import LocalCluster, check, psclient, say

JOB = {"job_id": "py-leases", "model": {"params": 64}, "optimizer": {"name": "sgd", "lr": 0.1},
       "lease_chunk": 20, "epochs": 1, "batch_size": 10, "heartbeat_timeout_ms": 1500}
N = 200

HOLDER = """
import json, sys, time
sys.path.insert(0, %r)
import psclient
w = psclient.connect(%r, insecure=True)
held = [w.lease(%d), w.lease(%d)]
print(json.dumps([[l.begin, l.count] for l in held]), flush=True)
time.sleep(120)
"""


def main():
    with LocalCluster(JOB, servers=2) as c:
        code = HOLDER % (os.path.dirname(psclient.__path__[0]), c.servers, N, N)
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        held = json.loads(holder.stdout.readline())
        check(len(held) == 2 and all(n == 20 for _, n in held), held)
        lease0 = c.status()[0]["lease_epochs"][0]
        check(lease0["examples_handed_out"] == 40, lease0)
        say(f"the holder leased {held}; SIGKILL")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        seen = np.zeros(N, int)
        order = []
        t = time.monotonic()
        with psclient.connect(c.servers, insecure=True) as w:
            for lease in w.leases(N):
                seen[lease.begin:lease.begin + lease.count] += 1
                order.append(lease.begin)
                w.pull()
                w.push()
            waited = time.monotonic() - t
            st = w.status()[0]
        ep = st["lease_epochs"][0]
        say(f"the other worker trained chunks {order} in {waited:.1f} s; epoch: {ep}")
        check(np.all(seen == 1), f"every example once: {seen}")
        check(all(b in order[-2:] for b, _ in held), "the killed worker's chunks came last")
        check(waited >= 1.0, "it waited for the holder's heartbeat timeout")
        check(ep["finished"] and ep["chunks_completed"] == 10 and ep["examples_completed"] == N, ep)
        check(ep["examples_rehanded"] == 40 and ep["reclaims"] >= 1, ep)
        check(st["workers_dropped"] >= 1, st["workers_dropped"])
    say("python.leases: every check passed")


if __name__ == "__main__":
    main()
