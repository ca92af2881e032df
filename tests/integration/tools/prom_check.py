#!/usr/bin/env python3
"""Asks a running Prometheus, through its HTTP API, whether it scraped a
cluster's servers and workers, and whether every query of the Grafana
dashboard answers with data.

  prom_check.py PROM_URL DASHBOARD.json SERVERS WORKERS TIMEOUT_S

Each check waits (all of them together at most TIMEOUT_S) until its query
answers as it must: series appear as scrapes and evaluations come in.
Prints what it saw; exits 1 with the reason on the first check that is
not met in time."""
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request

url, dash_path = sys.argv[1], sys.argv[2]
servers, workers, timeout = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])


def fail(msg):
    print("prom_check: FAIL: " + msg)
    sys.exit(1)


def query(q):
    u = url + "/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(u, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        fail("query %r: %s" % (q, body))
    return body["data"]["result"]


def values(result):
    return [float(s["value"][1]) for s in result]


def wait_for(q, ok):
    """q's result once ok(result) holds; fails after the timeout."""
    res = []
    while time.time() < deadline:
        try:
            res = query(q)
        except OSError:
            res = []
        if ok(res):
            return res
        time.sleep(1)
    fail("%s after %.0f s: %s" % (q, timeout, res))


# 1. The pushes' rate, per shard, once two scrapes are in.
deadline = time.time() + timeout
rates = wait_for("rate(ps_pushes_total[30s])",
                 lambda r: len(r) == servers and all(v > 0 for v in values(r)))
shards = sorted(s["metric"]["shard"] for s in rates)
if shards != [str(i) for i in range(servers)]:
    fail("shards of rate(ps_pushes_total[30s]): %s" % shards)
print("rate(ps_pushes_total[30s]): " + ", ".join(
    "shard %s %.1f/s" % (s["metric"]["shard"], float(s["value"][1])) for s in rates))

# 2. Every target up: the servers over HTTPS with the read-only token, the
# workers over HTTP.
up = wait_for("up", lambda r: len(r) == servers + workers and all(v == 1 for v in values(r)))
print("up: %d targets, all 1" % len(up))

# 3. The workers' counters and histograms.
ex = wait_for("rate(ps_worker_examples_total[30s])",
              lambda r: len(r) == workers and all(v > 0 for v in values(r)))
print("rate(ps_worker_examples_total[30s]): " + ", ".join(
    "worker %s %.0f ex/s" % (s["metric"]["worker"], float(s["value"][1])) for s in ex))
q = 'histogram_quantile(0.5, sum by (le, phase) (rate(ps_worker_step_seconds_bucket[30s])))'
med = wait_for(q, lambda r: sorted(x["metric"]["phase"] for x in r) == ["compute", "pull", "push"]
               and all(v > 0 and math.isfinite(v) for v in values(r)))
print("median step seconds: " + ", ".join(
    "%s %.2g" % (s["metric"]["phase"], float(s["value"][1])) for s in med))
# a checkpoint set every 2 s: each shard wrote one within the last minute
ckpt = wait_for("ps_checkpoint_last_success_timestamp_seconds",
                lambda r: len(r) == servers and all(0 < time.time() - v < 60 for v in values(r)))
now = time.time()
print("checkpoint age: " + ", ".join("%.1f s" % (now - v) for v in values(ckpt)))

# 4. The dashboard: every metric it names is one the processes expose, and
# every query answers with at least one series.
with urllib.request.urlopen(url + "/api/v1/label/__name__/values", timeout=10) as r:
    known = set(json.load(r)["data"])
dash = json.load(open(dash_path))
functions = {"rate", "sum", "by", "histogram_quantile", "max", "increase", "time", "on",
             "group_left", "le", "phase", "shard", "worker", "job", "instance", "program"}
n = 0
for panel in dash["panels"]:
    for t in panel["targets"]:
        expr = t["expr"]
        for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\[[^]]*\]', "", expr)):
            if name in functions:
                continue
            if name not in known:
                fail("panel %r: %r names %s, which no process exposes" % (panel["title"], expr, name))
        # (a series may need a second scrape or the first evaluation)
        wait_for(expr, lambda r: len(r) > 0)
        n += 1
print("dashboard: %d queries of %d panels answered" % (n, len(dash["panels"])))
print("prom_check: ok")
