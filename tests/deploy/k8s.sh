#!/usr/bin/env bash
# Checks the Kubernetes manifests of deploy/k8s against a build:
#   tests/deploy/k8s.sh BUILD_DIR
# - yamllint (line length relaxed to 120, no "---" required) passes on every
#   YAML file under deploy/k8s;
# - each kustomization (deploy/k8s, overlays/gpu, overlays/shared-checkpoints,
#   elastic) renders, with dummy files for the secretGenerators in a copy
#   made in a temporary directory. Kustomize is seldom installed, so a small
#   renderer here applies what these kustomizations use (resources, the
#   generators with name hashes, labels/commonLabels, images, JSON 6902 and
#   strategic merge patches, namespace) and refuses any other key; where
#   `kubectl kustomize` (kustomize v4.1 or later) or `kustomize` is
#   installed, its output must equal the renderer's (hashes aside);
# - kubernetes-validate --strict accepts every rendered object for Kubernetes
#   1.30 and the newest version it has schemas for;
# - the semantics, in Python: every ps-server/ps-worker command line (the
#   containers' and the exec probes', run through their shell with each
#   pod's name, index and CPU limit) uses flags of BUILD_DIR's programs and
#   parses (the real program, given --help); the Service selects the
#   StatefulSet's pods and is its serviceName; --ps lists ps-N.ps:2222 for
#   every replica and --index is the pod's ordinal; the certificate, the
#   probes' address and the --ps entry name the same host; the Indexed Job's
#   --num-workers and --index agree with completions; podFailurePolicy fails
#   the Job on ps-worker's exit code for a bad flag and retries its exit
#   code for unreachable servers; every volumeMount has a volume, every file
#   a flag names is a key of the mounted ConfigMap or Secret; the PDB selects
#   the servers; security contexts and resources are set; the gpu overlay
#   requests nvidia.com/gpu and passes --device cuda; the elastic workers'
#   job has lease_chunk; the job files equal their sources in deploy/jobs.
# kubernetes-validate, yamllint and PyYAML come from PyPI into a venv kept
# in BUILD_DIR/venv-k8s; exits 77 (skipped) when they cannot be installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:?usage: tests/deploy/k8s.sh BUILD_DIR}" && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIPPED: $*"; exit 77; }
for prog in ps-server ps-worker; do
  [ -x "$build/$prog" ] || fail "$build/$prog is not built"
done
[ -d "$root/deploy/k8s" ] || fail "$root/deploy/k8s is missing"
command -v python3 >/dev/null || skip "python3 is not installed"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

venv=$build/venv-k8s
imports="import kubernetes_validate, yamllint, yaml"
if ! "$venv/bin/python" -c "$imports" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv" >"$tmp/venv.log" 2>&1 \
    || { tail -3 "$tmp/venv.log"; rm -rf "$venv"; skip "python3 -m venv failed (Debian: python3-venv)"; }
  "$venv/bin/pip" install --quiet --timeout 30 --retries 2 kubernetes-validate yamllint pyyaml \
    >>"$tmp/venv.log" 2>&1 \
    || { tail -3 "$tmp/venv.log"; rm -rf "$venv";
         skip "pip cannot install kubernetes-validate, yamllint and pyyaml (PyPI unreachable?)"; }
  "$venv/bin/python" -c "$imports" >>"$tmp/venv.log" 2>&1 \
    || { tail -3 "$tmp/venv.log"; fail "kubernetes-validate, yamllint or pyyaml installed but do not import"; }
fi

# yamllint: the default rules, with longer lines and no "---" required.
cat >"$tmp/yamllint.yaml" <<'EOF'
extends: default
rules:
  line-length:
    max: 120
  document-start: disable
EOF
mapfile -t yamls < <(cd "$root" && find deploy/k8s \( -name secrets -prune \) -o \
  \( -name '*.yaml' -o -name '*.yml' \) -type f -print | sort)
[ "${#yamls[@]}" -gt 0 ] || fail "no YAML files under deploy/k8s"
(cd "$root" && "$venv/bin/yamllint" --strict -c "$tmp/yamllint.yaml" "${yamls[@]}") \
  || fail "yamllint found problems in deploy/k8s (above)"
echo "yamllint: ${#yamls[@]} files under deploy/k8s pass ($("$venv/bin/yamllint" --version))"

# A kustomize to compare the renderer with, when there is one (v4.1 on:
# the labels field).
kustomize=()
kversion() { grep -o 'v[0-9][0-9.]*' | head -1; }
if command -v kustomize >/dev/null; then
  v=$(kustomize version 2>/dev/null | kversion || true)
  [ -n "$v" ] && kustomize=(kustomize build) && kname="kustomize $v"
fi
if [ "${#kustomize[@]}" = 0 ] && command -v kubectl >/dev/null; then
  v=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: //p' | kversion || true)
  [ -n "$v" ] && kustomize=(kubectl kustomize) && kname="kubectl kustomize ($v)"
fi
if [ "${#kustomize[@]}" -gt 0 ]; then
  IFS=. read -r kmaj kmin _ <<<"${v#v}"
  if [ "$kmaj" -lt 4 ] || { [ "$kmaj" = 4 ] && [ "${kmin:-0}" -lt 1 ]; }; then
    echo "note: $kname is older than v4.1 (no labels field): not compared"
    kustomize=()
  fi
fi

# Fake programs on PATH: each call writes its argv (NUL-separated) to a file
# of its own, then runs the real program with --help appended (exit 0 when
# every flag and value parses; 2 and the reason when not).
mkdir -p "$tmp/bin" "$tmp/calls"
for prog in ps-server ps-worker; do
  cat >"$tmp/bin/$prog" <<EOF
#!/bin/sh
f=\$(mktemp "$tmp/calls/call.XXXXXX")
printf '%s\\0' "$prog" "\$@" >"\$f"
exec "$build/$prog" "\$@" --help >/dev/null
EOF
  chmod +x "$tmp/bin/$prog"
done

# The copy to render: deploy/k8s without any real secrets, and the renders.
mkdir -p "$tmp/tree/deploy"
(cd "$root/deploy" && tar --exclude=secrets -cf - k8s) | (cd "$tmp/tree/deploy" && tar -xf -)

"$venv/bin/python" - "$root" "$build" "$tmp" "${kustomize[@]}" <<'PY'
import base64, copy, difflib, glob, hashlib, json, math, os, re, shlex, subprocess, sys
import yaml
import kubernetes_validate

root, build, tmp = sys.argv[1:4]
kustomize = sys.argv[4:]
tree = os.path.join(tmp, "tree")
k8s = os.path.join(tree, "deploy", "k8s")
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg, file=sys.stderr)


class Refused(Exception):
    pass


# ---------------------------------------------------------------- renderer
KUST_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_KEYS = {"apiVersion", "kind", "resources", "labels", "commonLabels", "images",
              "configMapGenerator", "secretGenerator", "patches", "namespace",
              "generatorOptions"}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kust_file(d):
    for n in KUST_FILES:
        if os.path.isfile(os.path.join(d, n)):
            return os.path.join(d, n)
    raise Refused("%s has no kustomization.yaml" % d)


def pod_specs(obj):
    """The pod specs an object holds (templates of workloads, CronJobs)."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        return [spec]
    if obj.get("kind") == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    t = spec.get("template")
    return [t["spec"]] if isinstance(t, dict) and "spec" in t else []


def containers(ps):
    return (ps.get("initContainers") or []) + (ps.get("containers") or [])


def generate(d, g, kind):
    unknown = set(g) - {"name", "files", "literals", "behavior", "type"}
    if unknown:
        raise Refused("%s: %sGenerator %s: the test's renderer does not know %s"
                      % (d, kind[0].lower() + kind[1:], g.get("name"), sorted(unknown)))
    data = {}
    for src in g.get("files", []):
        key, _, path = src.partition("=") if "=" in src else (os.path.basename(src), "", src)
        full = os.path.normpath(os.path.join(d, path))
        if not full.startswith(os.path.normpath(d) + os.sep):
            raise Refused("%s: %s: kustomize reads no file outside the kustomization's directory"
                          % (d, path))
        with open(full, "rb") as f:
            data[key] = f.read()
    for lit in g.get("literals", []):
        k, _, v = lit.partition("=")
        data[k] = v.encode()
    obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": g["name"]}}
    if kind == "Secret":
        obj["type"] = g.get("type", "Opaque")
        obj["data"] = {k: base64.b64encode(v).decode() for k, v in data.items()}
    else:
        obj["data"] = {k: v.decode() for k, v in data.items()}
    return obj


def ptr_parts(path):
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json6902(obj, ops, where):
    for op in ops:
        parts = ptr_parts(op["path"])
        parent = obj
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        kind = op["op"]
        if kind == "add":
            if isinstance(parent, list):
                if last == "-":
                    parent.append(copy.deepcopy(op["value"]))
                else:
                    parent.insert(int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]
        elif kind == "replace":
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(op["value"])
            else:
                if last not in parent:
                    raise Refused("%s: replace %s: no such field" % (where, op["path"]))
                parent[last] = copy.deepcopy(op["value"])
        else:
            raise Refused("%s: the test's renderer does not know the JSON patch op %r" % (where, kind))


def smp(base, patch, where):
    """A strategic merge patch, the parts these manifests may use: maps merge,
    lists of maps with a name merge by name, other lists are replaced."""
    for k, v in patch.items():
        if k.startswith("$"):
            raise Refused("%s: the test's renderer does not know the directive %s" % (where, k))
        if v is None:
            base.pop(k, None)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            smp(base[k], v, where)
        elif (isinstance(v, list) and isinstance(base.get(k), list) and v
              and all(isinstance(x, dict) and "name" in x for x in v + base[k])):
            by_name = {x["name"]: x for x in base[k]}
            for x in v:
                if x["name"] in by_name:
                    smp(by_name[x["name"]], x, where)
                else:
                    base[k].append(copy.deepcopy(x))
        else:
            base[k] = copy.deepcopy(v)


def gvk_matches(obj, target):
    api = obj.get("apiVersion", "")
    group, _, version = api.rpartition("/")
    for key, have in (("group", group), ("version", version), ("kind", obj.get("kind")),
                      ("name", obj["metadata"].get("name")),
                      ("namespace", obj["metadata"].get("namespace", ""))):
        if key in target and not re.fullmatch(target[key], have or ""):
            return False
    unknown = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise Refused("patch target keys %s are not known to the test's renderer" % sorted(unknown))
    return True


def add_labels(obj, pairs, selectors, templates):
    obj["metadata"].setdefault("labels", {}).update(pairs)
    kind, spec = obj["kind"], obj.get("spec")
    if not isinstance(spec, dict):
        return
    if selectors:
        if kind == "Service":
            spec.setdefault("selector", {}).update(pairs)
        elif kind in WORKLOADS and kind != "Job":
            spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        elif "matchLabels" in (spec.get("selector") or {}):
            spec["selector"]["matchLabels"].update(pairs)
        for vct in spec.get("volumeClaimTemplates") or []:
            vct.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    if selectors or templates:
        if kind in WORKLOADS:
            spec.setdefault("template", {}).setdefault("metadata", {}).setdefault(
                "labels", {}).update(pairs)
    if selectors:
        for ps in pod_specs(obj):
            aff = ps.get("affinity") or {}
            for a in ("podAffinity", "podAntiAffinity"):
                terms = (aff.get(a) or {})
                for t in terms.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
                    if "matchLabels" in (t.get("labelSelector") or {}):
                        t["labelSelector"]["matchLabels"].update(pairs)
                for w in terms.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
                    t = w.get("podAffinityTerm") or {}
                    if "matchLabels" in (t.get("labelSelector") or {}):
                        t["labelSelector"]["matchLabels"].update(pairs)
            for t in ps.get("topologySpreadConstraints") or []:
                if "matchLabels" in (t.get("labelSelector") or {}):
                    t["labelSelector"]["matchLabels"].update(pairs)


def set_images(obj, images):
    for ps in pod_specs(obj):
        for c in containers(ps):
            ref = c.get("image", "")
            name, digest = (ref.split("@", 1) + [None])[:2]
            tag = None
            if ":" in name.rsplit("/", 1)[-1]:
                name, tag = name.rsplit(":", 1)
            for im in images:
                if im["name"] != name:
                    continue
                name = im.get("newName", name)
                tag = im.get("newTag", tag)
                if "digest" in im:
                    digest, tag = im["digest"], None
                c["image"] = name + (":" + tag if tag else "") + ("@" + digest if digest else "")
                break


def render_dir(d, generated):
    kf = kust_file(d)
    with open(kf) as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise Refused("%s: the test's renderer does not know %s: teach it (tests/deploy/k8s.sh)"
                      % (kf, sorted(unknown)))
    objs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(d, r))
        if os.path.isdir(p):
            objs += render_dir(p, generated)
        else:
            if not p.startswith(os.path.normpath(d) + os.sep):
                raise Refused("%s: resource %s is outside the kustomization's directory" % (kf, r))
            objs += load_docs(p)
    for key, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for g in k.get(key, []):
            new = generate(d, g, kind)
            same = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == g["name"]]
            behavior = g.get("behavior", "create")
            if behavior == "create":
                if same:
                    raise Refused("%s: %s %s exists already" % (kf, kind, g["name"]))
                objs.append(new)
                generated.add((kind, g["name"]))
            elif not same:
                raise Refused("%s: %s %s (behavior %s) has nothing to %s" % (kf, kind, g["name"],
                                                                          behavior, behavior))
            elif behavior == "replace":
                same[0]["data"] = new["data"]
            elif behavior == "merge":
                same[0].setdefault("data", {}).update(new["data"])
            else:
                raise Refused("%s: behavior %r" % (kf, behavior))
    for i, p in enumerate(k.get("patches", [])):
        where = "%s: patches[%d]" % (kf, i)
        if "path" in p:
            with open(os.path.join(d, p["path"])) as f:
                text = f.read()
        else:
            text = p["patch"]
        body = yaml.safe_load(text)
        target = p.get("target")
        if isinstance(body, list):
            if not target:
                raise Refused("%s: a JSON 6902 patch needs a target" % where)
            hits = [o for o in objs if gvk_matches(o, target)]
            if not hits:
                raise Refused("%s: the target matches no object" % where)
            for o in hits:
                json6902(o, body, where)
        else:
            body = dict(body)
            directive = body.pop("$patch", None)
            ident = {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name")}
            hits = [o for o in objs if o["kind"] == ident["kind"] and o["metadata"]["name"] == ident["name"]
                    and (not target or gvk_matches(o, target))]
            if not hits:
                raise Refused("%s: the patch matches no object" % where)
            if directive == "delete":
                objs = [o for o in objs if not any(o is h for h in hits)]
            elif directive is None:
                for o in hits:
                    smp(o, body, where)
            else:
                raise Refused("%s: $patch: %s is not known to the test's renderer" % (where, directive))
    label_sets = [{"pairs": k["commonLabels"], "includeSelectors": True}] if "commonLabels" in k else []
    label_sets += k.get("labels", [])
    for ls in label_sets:
        unknown = set(ls) - {"pairs", "includeSelectors", "includeTemplates"}
        if unknown:
            raise Refused("%s: labels: %s not known to the test's renderer" % (kf, sorted(unknown)))
        for o in objs:
            add_labels(o, ls["pairs"], ls.get("includeSelectors", False),
                       ls.get("includeTemplates", False))
    if k.get("images"):
        for o in objs:
            set_images(o, k["images"])
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    gen_opts = k.get("generatorOptions") or {}
    if set(gen_opts) - {"disableNameSuffixHash"}:
        raise Refused("%s: generatorOptions: only disableNameSuffixHash is known" % kf)
    if gen_opts.get("disableNameSuffixHash"):
        generated.difference_update({(kind, g["name"]) for key, kind in
                                     (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret"))
                                     for g in k.get(key, [])})
    return objs


def rename_refs(objs, names):
    """Rewrites references to ConfigMaps and Secrets by the map names:
    {(kind, old): new}."""
    def ren(kind, n):
        return names.get((kind, n), n)
    for o in objs:
        for ps in pod_specs(o):
            for v in ps.get("volumes") or []:
                if "configMap" in v:
                    v["configMap"]["name"] = ren("ConfigMap", v["configMap"]["name"])
                if "secret" in v:
                    v["secret"]["secretName"] = ren("Secret", v["secret"]["secretName"])
                for s in (v.get("projected") or {}).get("sources") or []:
                    if "configMap" in s:
                        s["configMap"]["name"] = ren("ConfigMap", s["configMap"]["name"])
                    if "secret" in s:
                        s["secret"]["name"] = ren("Secret", s["secret"]["name"])
            for c in containers(ps):
                for e in c.get("env") or []:
                    vf = e.get("valueFrom") or {}
                    if "configMapKeyRef" in vf:
                        vf["configMapKeyRef"]["name"] = ren("ConfigMap", vf["configMapKeyRef"]["name"])
                    if "secretKeyRef" in vf:
                        vf["secretKeyRef"]["name"] = ren("Secret", vf["secretKeyRef"]["name"])
                for e in c.get("envFrom") or []:
                    if "configMapRef" in e:
                        e["configMapRef"]["name"] = ren("ConfigMap", e["configMapRef"]["name"])
                    if "secretRef" in e:
                        e["secretRef"]["name"] = ren("Secret", e["secretRef"]["name"])
            for s in ps.get("imagePullSecrets") or []:
                s["name"] = ren("Secret", s["name"])


def render(d):
    """The objects of the kustomization in d, generated ConfigMaps and
    Secrets named with a hash of their contents (as kustomize does; not its
    hash), references to them renamed."""
    generated = set()
    objs = render_dir(d, generated)
    names = {}
    for o in objs:
        key = (o["kind"], o["metadata"]["name"])
        if key in generated:
            h = hashlib.sha256(json.dumps(o, sort_keys=True).encode()).hexdigest()[:10]
            names[key] = o["metadata"]["name"] = "%s-%s" % (key[1], h)
    rename_refs(objs, names)
    return objs, {k[1]: v for k, v in names.items()}, names


def unhash(objs):
    """Generated names back to the generators' names (NAME-HASH10 -> NAME),
    for comparing two renderings."""
    objs = copy.deepcopy(objs)
    names = {}
    for o in objs:
        if o["kind"] in ("ConfigMap", "Secret"):
            m = re.fullmatch(r"(.+)-[a-z0-9]{10}", o["metadata"]["name"])
            if m:
                names[(o["kind"], o["metadata"]["name"])] = m.group(1)
                o["metadata"]["name"] = m.group(1)
    rename_refs(objs, names)
    return sorted(objs, key=lambda o: (o["kind"], o["metadata"]["name"]))


# ---------------------------------------------------------------- the programs
def help_of(prog):
    out = subprocess.run([os.path.join(build, prog), "--help"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit("FAIL: %s --help exits %d" % (prog, out.returncode))
    flags = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^  (--[a-z][a-z0-9-]*)(?: ([A-Z][A-Z0-9_]*))?(?:\s|$)", line)
        if m:
            flags[m.group(1)] = m.group(2) is not None
    codes = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^  ([0-9])  (.*)", line)
        if m:
            codes[m.group(2)] = int(m.group(1))
    return flags, codes, out.stdout


HELP = {p: help_of(p) for p in ("ps-server", "ps-worker")}
for p in HELP:
    if len(HELP[p][0]) < 10:
        raise SystemExit("FAIL: %s --help: only %d flags found (%s)" % (p, len(HELP[p][0]), sorted(HELP[p][0])))


def exit_code(prog, starts):
    for text, code in HELP[prog][1].items():
        if text.startswith(starts):
            return code
    raise SystemExit("FAIL: %s --help: no exit code described as '%s...'" % (prog, starts))


WORKER_BAD_FLAG = exit_code("ps-worker", "a bad command line")
WORKER_UNREACHABLE = exit_code("ps-worker", "the servers did not answer")
rc = subprocess.run([os.path.join(build, "ps-worker"), "--no-such-flag"], capture_output=True).returncode
if rc != WORKER_BAD_FLAG:
    fail("ps-worker --no-such-flag exits %d; its --help says %d" % (rc, WORKER_BAD_FLAG))
FILE_FLAGS = {"--job", "--tls-cert", "--tls-key", "--tls-ca", "--token-file", "--read-token-file",
              "--metrics-token-file"}


def parse_argv(argv, where):
    """{flag: value or True} of a ps-server/ps-worker argv; unknown flags fail."""
    prog = argv[0]
    flags = HELP[prog][0]
    out, i = {}, 1
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if not a.startswith("--"):
            fail("%s: %s: '%s' is not a flag" % (where, prog, a))
        elif name not in flags:
            fail("%s: %s has no flag %s (not in %s --help)" % (where, prog, name,
                                                             os.path.join(build, prog)))
        elif flags[name] and "=" not in a:
            if i + 1 >= len(argv):
                fail("%s: %s %s wants a value" % (where, prog, name))
            else:
                out[name] = argv[i + 1]
            i += 1
        else:
            out[name] = a.split("=", 1)[1] if "=" in a else True
        i += 1
    return out


def quantity(q):
    q = str(q)
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", q)
    if not m:
        raise ValueError(q)
    mult = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
            "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}[m.group(2)]
    return float(m.group(1)) * mult


def pod_env(c, pod, where):
    """The container's environment in a pod {name, index, annotations}: its
    static values and the downward API's."""
    env = {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        vf = e.get("valueFrom") or {}
        if "fieldRef" in vf:
            fp = vf["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", fp)
            if fp == "metadata.name":
                env[e["name"]] = pod["name"]
            elif fp == "metadata.namespace":
                env[e["name"]] = "ns"
            elif fp in ("status.podIP", "status.hostIP"):
                env[e["name"]] = "10.0.0.7"
            elif fp == "spec.nodeName":
                env[e["name"]] = "node-1"
            elif m and m.group(2) in pod.get(m.group(1), {}):
                env[e["name"]] = pod[m.group(1)][m.group(2)]
            else:
                fail("%s: env %s: the pod has no %s" % (where, e["name"], fp))
        elif "resourceFieldRef" in vf:
            r = vf["resourceFieldRef"]
            kind, _, res = r["resource"].partition(".")
            val = ((c.get("resources") or {}).get(kind) or {}).get(res)
            if val is None:
                fail("%s: env %s: the container sets no %s (the node's would be used)"
                     % (where, e["name"], r["resource"]))
                val = "1"
            env[e["name"]] = str(int(math.ceil(quantity(val) / quantity(r.get("divisor", "1")))))
        else:
            fail("%s: env %s: the test cannot give it a value" % (where, e["name"]))
    return env


def k8s_expand(s, env):
    """Kubernetes' $(VAR) expansion of command and args."""
    def rep(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", rep, s)


def run_argv(argv, env, where):
    """Runs argv (a container's command and args, or an exec probe) with the
    fake programs first on PATH; returns the ps-server/ps-worker argvs it
    ran. A run that fails (a flag or value the real program refuses) fails."""
    for f in glob.glob(os.path.join(tmp, "calls", "call.*")):
        os.unlink(f)
    argv = list(argv)
    if os.path.basename(argv[0]) in ("ps-server", "ps-worker"):
        argv[0] = os.path.join(tmp, "bin", os.path.basename(argv[0]))
    full_env = dict(env, PATH=os.path.join(tmp, "bin") + ":/usr/bin:/bin", HOME=tmp)
    try:
        out = subprocess.run(argv, env=full_env, cwd=tmp, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        fail("%s: %s: %s" % (where, argv[:3], e))
        return []
    if out.returncode != 0:
        fail("%s: the command line does not parse (exit %d, with --help appended):\n  %s\n  %s"
             % (where, out.returncode, " ".join(shlex.quote(a) for a in argv),
                (out.stderr.strip() or out.stdout.strip()).replace("\n", "\n  ")))
    calls = []
    for f in sorted(glob.glob(os.path.join(tmp, "calls", "call.*"))):
        with open(f, "rb") as fh:
            calls.append([a.decode() for a in fh.read().split(b"\0")[:-1]])
        os.unlink(f)
    if not calls:
        fail("%s: runs neither ps-server nor ps-worker (found by name on PATH)" % where)
    return calls


# ---------------------------------------------------------------- checks
def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_of(o):
    """The pods a workload makes: name, annotations, labels."""
    kind, name, spec = o["kind"], o["metadata"]["name"], o["spec"]
    if kind == "StatefulSet":
        return [{"name": "%s-%d" % (name, i), "index": i, "annotations": {},
                 "labels": {"apps.kubernetes.io/pod-index": str(i)}}
                for i in range(spec.get("replicas", 1))]
    if kind == "Job" and spec.get("completionMode") == "Indexed":
        return [{"name": "%s-%d-x7k2p" % (name, i), "index": i, "labels": {},
                 "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}}
                for i in range(spec.get("completions", 1))]
    if kind == "Deployment":
        return [{"name": "%s-5d8f7c9b4-x7k2p" % name, "index": None, "annotations": {}, "labels": {}}]
    return [{"name": "%s-x7k2p" % name, "index": None, "annotations": {}, "labels": {}}]


def mount_for(c, path):
    """The volumeMount whose mountPath holds path, the longest."""
    best = None
    for m in c.get("volumeMounts") or []:
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = m
    return best


def volume_keys(vol, by_name):
    """The file names a ConfigMap or Secret volume shows, or None for another
    kind of volume."""
    for kind, field, ref in (("configMap", "name", "ConfigMap"), ("secret", "secretName", "Secret")):
        if kind in vol:
            src = vol[kind]
            obj = by_name.get((ref, src[field]))
            if obj is None:
                return set()
            keys = set((obj.get("data") or {}).keys()) | set((obj.get("stringData") or {}).keys())
            if src.get("items"):
                return {it["path"] for it in src["items"] if it["key"] in keys}
            return keys
    return None


def check_variant(label, objs):
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    # kubernetes-validate, strict.
    versions = ["1.30", kubernetes_validate.utils.latest_version()]
    for o in objs:
        for v in versions:
            try:
                kubernetes_validate.validate(o, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                fail("%s: %s %s: kubernetes-validate --strict (Kubernetes %s): %s at %s"
                     % (label, o["kind"], o["metadata"]["name"], v, e.message, path or "/"))
            except kubernetes_validate.SchemaNotFoundError as e:
                fail("%s: %s %s: %s" % (label, o["kind"], o["metadata"]["name"], e.message))
    # Labels and namespace.
    for o in objs:
        n = "%s: %s %s" % (label, o["kind"], o["metadata"]["name"])
        if o["metadata"].get("namespace"):
            fail("%s: sets namespace %s (kustomize or kubectl -n sets it)" % (n, o["metadata"]["namespace"]))
        if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/name") != "ps":
            fail("%s: no label app.kubernetes.io/name: ps" % n)
        for ps in pod_specs(o):
            if (o["spec"]["template"].get("metadata", {}).get("labels") or {}).get(
                    "app.kubernetes.io/name") != "ps":
                fail("%s: its pods lack the label app.kubernetes.io/name: ps" % n)

    servers, workers = [], []      # (object, container, [(pod, argv)])
    for o in objs:
        for ps in pod_specs(o):
            n = "%s: %s %s" % (label, o["kind"], o["metadata"]["name"])
            psc = ps.get("securityContext") or {}
            vols = {v["name"]: v for v in ps.get("volumes") or []}
            vcts = {t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates") or []}
            for name, v in vols.items():
                for kind, field, ref in (("configMap", "name", "ConfigMap"), ("secret", "secretName", "Secret")):
                    if kind in v:
                        obj = by_name.get((ref, v[kind][field]))
                        if obj is None:
                            fail("%s: volume %s: no %s %s in the rendering" % (n, name, ref, v[kind][field]))
                            continue
                        keys = set(obj.get("data") or {})
                        for it in v[kind].get("items") or []:
                            if it["key"] not in keys:
                                fail("%s: volume %s: %s %s has no key %s (its generator makes %s)"
                                     % (n, name, ref, v[kind][field], it["key"], sorted(keys)))
                pvc = (v.get("persistentVolumeClaim") or {}).get("claimName")
                if pvc and ("PersistentVolumeClaim", pvc) not in by_name:
                    fail("%s: volume %s: no PersistentVolumeClaim %s in the rendering" % (n, name, pvc))
            for c in containers(ps):
                cn = "%s container %s" % (n, c["name"])
                csc = c.get("securityContext") or {}
                if not (csc.get("runAsNonRoot", psc.get("runAsNonRoot"))):
                    fail("%s: not runAsNonRoot" % cn)
                if (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
                    fail("%s: no seccompProfile RuntimeDefault" % cn)
                if not csc.get("readOnlyRootFilesystem"):
                    fail("%s: no readOnlyRootFilesystem" % cn)
                if csc.get("allowPrivilegeEscalation") is not False:
                    fail("%s: allowPrivilegeEscalation is not false" % cn)
                if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
                    fail("%s: does not drop ALL capabilities" % cn)
                res = c.get("resources") or {}
                for kind in ("requests", "limits"):
                    for r in ("cpu", "memory"):
                        if r not in (res.get(kind) or {}):
                            fail("%s: no %s.%s" % (cn, kind, r))
                if not c.get("image"):
                    fail("%s: no image" % cn)
                for m in c.get("volumeMounts") or []:
                    if m["name"] not in vols and m["name"] not in vcts:
                        fail("%s: volumeMount %s at %s has no volume" % (cn, m["name"], m["mountPath"]))
                if not c.get("command"):
                    fail("%s: no command (the test does not know the image's entrypoint)" % cn)
                    continue
                # Only command lines of ps-server and ps-worker run here (an
                # init container's cp is not run on this machine).
                words = " ".join((c.get("command") or []) + (c.get("args") or []))
                if not re.search(r"(^|[\s/])ps-(server|worker)(\s|$)", words):
                    if c not in (ps.get("initContainers") or []):
                        fail("%s: runs neither ps-server nor ps-worker" % cn)
                    continue
                runs = []
                for pod in pods_of(o):
                    pw = "%s (pod %s)" % (cn, pod["name"])
                    env = pod_env(c, pod, pw)
                    argv = [k8s_expand(a, env) for a in (c.get("command") or []) + (c.get("args") or [])]
                    calls = run_argv(argv, env, pw)
                    probes = {}
                    for pk in ("startupProbe", "readinessProbe", "livenessProbe"):
                        p = c.get(pk)
                        if p and "exec" in p:
                            # Kubernetes expands only static env values in a probe.
                            pcalls = run_argv(p["exec"]["command"], env, "%s %s" % (pw, pk))
                            probes[pk] = [parse_argv(a, "%s %s" % (pw, pk)) for a in pcalls]
                            for a in pcalls:
                                check_files(a, c, vols, by_name, "%s %s" % (pw, pk))
                    for a in calls:
                        check_files(a, c, vols, by_name, pw)
                        runs.append((pod, a, parse_argv(a, pw), probes))
                progs = {a[0] for _, a, _, _ in runs}
                if "ps-server" in progs:
                    servers.append((o, c, ps, runs))
                if "ps-worker" in progs:
                    workers.append((o, c, ps, runs))
    check_servers(label, objs, servers, workers)
    check_workers(label, objs, servers, workers)
    return servers, workers


def check_files(argv, c, vols, by_name, where):
    """Each file a flag names lies in a volume; in a ConfigMap's or a
    Secret's, it is one of its keys."""
    opts = parse_argv(argv, where)
    for flag, val in opts.items():
        if flag not in FILE_FLAGS and flag not in ("--checkpoint-dir", "--data-dir"):
            continue
        if not isinstance(val, str) or not val.startswith("/"):
            fail("%s: %s %s: not an absolute path" % (where, flag, val))
            continue
        m = mount_for(c, val)
        if m is None:
            fail("%s: %s %s: no volume is mounted there" % (where, flag, val))
            continue
        vol = vols.get(m["name"])
        if flag == "--data-dir":
            continue
        if flag == "--checkpoint-dir":
            if m.get("readOnly"):
                fail("%s: %s %s: the mount is read-only" % (where, flag, val))
            if vol is not None and "persistentVolumeClaim" not in vol:
                fail("%s: %s %s: volume %s is not a PersistentVolumeClaim" % (where, flag, val, m["name"]))
            continue
        if vol is None:
            fail("%s: %s %s: volume %s is not a file's volume" % (where, flag, val, m["name"]))
            continue
        keys = volume_keys(vol, by_name)
        rel = val[len(m["mountPath"].rstrip("/")) + 1:]
        if keys is not None and rel not in keys:
            fail("%s: %s %s: the volume %s (mounted at %s) has no file %s; it has %s"
                 % (where, flag, val, m["name"], m["mountPath"], rel, sorted(keys)))


def server_list(label, servers):
    if len(servers) != 1:
        fail("%s: %d workloads run ps-server, expected 1 (the StatefulSet)" % (label, len(servers)))
        return None, None
    o, c, ps, runs = servers[0]
    return o, runs


def check_servers(label, objs, servers, workers):
    o, runs = server_list(label, servers)
    if o is None:
        return
    n = "%s: %s %s" % (label, o["kind"], o["metadata"]["name"])
    if o["kind"] != "StatefulSet":
        fail("%s: ps-server runs in a %s, not a StatefulSet" % (n, o["kind"]))
        return
    spec = o["spec"]
    replicas = spec.get("replicas", 1)
    labels = spec["template"].get("metadata", {}).get("labels") or {}
    if spec.get("podManagementPolicy") != "Parallel":
        fail("%s: podManagementPolicy is not Parallel" % n)
    if not labels_match(spec["selector"].get("matchLabels"), labels):
        fail("%s: its selector does not select its pods" % n)
    if spec["template"]["spec"].get("terminationGracePeriodSeconds", 30) < 300:
        fail("%s: terminationGracePeriodSeconds under 300 (a final checkpoint on SIGTERM)" % n)
    svc = next((x for x in objs if x["kind"] == "Service" and x["metadata"]["name"] == spec.get("serviceName")), None)
    if svc is None:
        fail("%s: serviceName %s names no Service" % (n, spec.get("serviceName")))
        return
    sn = "%s: Service %s" % (label, svc["metadata"]["name"])
    if svc["spec"].get("clusterIP") != "None":
        fail("%s: not headless (clusterIP: None)" % sn)
    if not labels_match(svc["spec"].get("selector"), labels):
        fail("%s: its selector %s does not select the StatefulSet's pods %s"
             % (sn, svc["spec"].get("selector"), labels))
    for wo, _, _, _ in workers:
        wl = wo["spec"]["template"].get("metadata", {}).get("labels") or {}
        if labels_match(svc["spec"].get("selector"), wl):
            fail("%s: its selector also selects the pods of %s %s" % (sn, wo["kind"], wo["metadata"]["name"]))
    ports = {p.get("name"): p["port"] for p in svc["spec"].get("ports") or []}
    cports = {}
    for _, c, _, _ in servers:
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
    svc_name = svc["metadata"]["name"]
    pdbs = [x for x in objs if x["kind"] == "PodDisruptionBudget"
            and labels_match((x["spec"].get("selector") or {}).get("matchLabels"), labels)]
    if not pdbs:
        fail("%s: no PodDisruptionBudget selects the servers" % label)
    for p in pdbs:
        if not (p["spec"].get("maxUnavailable") == 0 or p["spec"].get("minAvailable", 0) == replicas):
            fail("%s: PodDisruptionBudget %s allows evicting a shard (maxUnavailable: 0 or minAvailable: %d)"
                 % (label, p["metadata"]["name"], replicas))
        for wo, _, _, _ in workers:
            wl = wo["spec"]["template"].get("metadata", {}).get("labels") or {}
            if labels_match(p["spec"]["selector"].get("matchLabels"), wl):
                fail("%s: PodDisruptionBudget %s also selects %s %s" % (label, p["metadata"]["name"],
                                                                      wo["kind"], wo["metadata"]["name"]))
    c = servers[0][1]
    for pk in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(pk)
        if not p:
            fail("%s: no %s" % (n, pk))
            continue
        if p.get("timeoutSeconds", 1) <= 10:
            fail("%s: %s timeoutSeconds %s: --status waits up to 10 s for an answer"
                 % (n, pk, p.get("timeoutSeconds", 1)))
    sp = c.get("startupProbe") or {}
    if sp and sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) < 300:
        fail("%s: the startupProbe allows under 5 minutes for a checkpoint restore" % n)
    for pod, argv, opts, probes in runs:
        pw = "%s (pod %s)" % (n, pod["name"])
        expect = ["%s-%d.%s:%d" % (o["metadata"]["name"], i, svc_name, ports.get("grpc", 0))
                  for i in range(replicas)]
        got = str(opts.get("--ps", "")).split(",")
        if got != expect:
            fail("%s: --ps %s; the StatefulSet's %d pods behind Service %s port grpc are %s"
                 % (pw, opts.get("--ps"), replicas, svc_name, ",".join(expect)))
        if str(opts.get("--index")) != str(pod["index"]):
            fail("%s: --index %s, not the pod's ordinal %d" % (pw, opts.get("--index"), pod["index"]))
        host = expect[pod["index"]].rsplit(":", 1)[0]
        listen = str(opts.get("--listen", ""))
        if listen != "0.0.0.0:%d" % ports.get("grpc", 0) or cports.get("grpc") != ports.get("grpc"):
            fail("%s: --listen %s; the Service's grpc port is %s, the container's %s"
                 % (pw, listen, ports.get("grpc"), cports.get("grpc")))
        mport = str(opts.get("--metrics-port"))
        if not (mport == str(ports.get("metrics")) == str(cports.get("metrics"))):
            fail("%s: --metrics-port %s; the Service's metrics port %s, the container's %s"
                 % (pw, mport, ports.get("metrics"), cports.get("metrics")))
        ann = o["spec"]["template"].get("metadata", {}).get("annotations") or {}
        if ann.get("prometheus.io/port") not in (None, mport):
            fail("%s: annotation prometheus.io/port %s, --metrics-port %s" % (pw, ann.get("prometheus.io/port"), mport))
        if opts.get("--metrics-host") != "0.0.0.0":
            fail("%s: --metrics-host %s: Prometheus scrapes from outside the pod" % (pw, opts.get("--metrics-host")))
        for f in ("--tls-cert", "--tls-key", "--tls-ca", "--token-file", "--read-token-file", "--checkpoint-dir"):
            if f not in opts:
                fail("%s: no %s" % (pw, f))
        if "--insecure" in opts:
            fail("%s: --insecure" % pw)
        cert = os.path.basename(str(opts.get("--tls-cert", "")))
        if cert != host + ".pem":
            fail("%s: --tls-cert %s, not the certificate of its name %s (%s.pem)"
                 % (pw, opts.get("--tls-cert"), host, host))
        for pk, plist in probes.items():
            for po in plist:
                addr = po.get("--status")
                if addr != expect[pod["index"]]:
                    fail("%s %s: --status %s, not %s, the name its certificate carries"
                         % (pw, pk, addr, expect[pod["index"]]))
                if not (po.get("--read-token-file") or po.get("--token-file")):
                    fail("%s %s: --status without a token" % (pw, pk))
                if "--tls-ca" not in po:
                    fail("%s %s: --status without --tls-ca" % (pw, pk))
        if not probes:
            fail("%s: no exec probe runs ps-server --status" % pw)


def check_workers(label, objs, servers, workers):
    if not workers:
        fail("%s: nothing runs ps-worker" % label)
        return
    if not servers:
        return
    so, sruns = servers[0][0], servers[0][3]
    sopts = sruns[0][2]
    ps_list = str(sopts.get("--ps", "")).split(",")
    slabels = so["spec"]["template"].get("metadata", {}).get("labels") or {}
    for o, c, ps, runs in workers:
        n = "%s: %s %s" % (label, o["kind"], o["metadata"]["name"])
        spec = o["spec"]
        if labels_match(slabels, spec["template"].get("metadata", {}).get("labels") or {}):
            fail("%s: its pods carry the servers' labels %s" % (n, slabels))
        ann = spec["template"].get("metadata", {}).get("annotations") or {}
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        evaluator = any("--evaluator" in opts for _, _, opts, _ in runs)
        for pod, argv, opts, _ in runs:
            pw = "%s (pod %s)" % (n, pod["name"])
            if str(opts.get("--ps", "")).split(",")[0] not in ps_list:
                fail("%s: --ps %s is not a shard of the servers' --ps %s" % (pw, opts.get("--ps"), ",".join(ps_list)))
            if "--insecure" in opts:
                fail("%s: --insecure" % pw)
            if "--tls-cert" in sopts and "--tls-ca" not in opts:
                fail("%s: no --tls-ca, and the servers serve TLS" % pw)
            if os.path.basename(str(opts.get("--tls-ca"))) != os.path.basename(str(sopts.get("--tls-ca"))):
                fail("%s: --tls-ca %s, the servers' CA is %s" % (pw, opts.get("--tls-ca"), sopts.get("--tls-ca")))
            tok = opts.get("--token-file")
            want = sopts.get("--read-token-file") if evaluator else sopts.get("--token-file")
            if tok is None or os.path.basename(str(tok)) != os.path.basename(str(want)):
                fail("%s: --token-file %s, expected the servers' %s" % (pw, tok, want))
            if "--metrics-port" in opts:
                mp = str(opts["--metrics-port"])
                if str(cports.get("metrics")) != mp or ann.get("prometheus.io/port", mp) != mp:
                    fail("%s: --metrics-port %s; the container's metrics port %s, the annotation %s"
                         % (pw, mp, cports.get("metrics"), ann.get("prometheus.io/port")))
                if opts.get("--metrics-host") != "0.0.0.0":
                    fail("%s: --metrics-host %s: Prometheus scrapes from outside the pod" % (pw, opts.get("--metrics-host")))
                mt = opts.get("--metrics-token-file")
                if not evaluator and os.path.basename(str(mt)) != os.path.basename(str(sopts.get("--read-token-file"))):
                    fail("%s: --metrics-token-file %s, not the servers' read-only token %s"
                         % (pw, mt, sopts.get("--read-token-file")))
            if o["kind"] == "Job" and spec.get("completionMode") == "Indexed":
                if str(opts.get("--index")) != str(pod["index"]):
                    fail("%s: --index %s, not the completion index %d" % (pw, opts.get("--index"), pod["index"]))
                if str(opts.get("--num-workers")) != str(spec.get("completions")):
                    fail("%s: --num-workers %s, the Job's completions %s"
                         % (pw, opts.get("--num-workers"), spec.get("completions")))
            if o["kind"] == "Deployment":
                for f in ("--index", "--num-workers"):
                    if f in opts:
                        fail("%s: %s: elastic workers take their data from leases" % (pw, f))
        if o["kind"] == "Job":
            if spec.get("completionMode") == "Indexed" and spec.get("parallelism") != spec.get("completions"):
                fail("%s: parallelism %s != completions %s: every worker trains at once"
                     % (n, spec.get("parallelism"), spec.get("completions")))
            if spec["template"]["spec"].get("restartPolicy") != "Never":
                fail("%s: restartPolicy is not Never (podFailurePolicy needs it)" % n)
            if "backoffLimit" not in spec:
                fail("%s: no backoffLimit" % n)
            rules = (spec.get("podFailurePolicy") or {}).get("rules") or []

            def action_for(code):
                for r in rules:
                    ec = r.get("onExitCodes")
                    if not ec or ec.get("containerName", c["name"]) != c["name"]:
                        continue
                    if (ec["operator"] == "In") == (code in ec["values"]):
                        return r["action"]
                return "Count"
            if action_for(WORKER_BAD_FLAG) != "FailJob":
                fail("%s: podFailurePolicy does not fail the Job on exit %d (ps-worker: a bad command line)"
                     % (n, WORKER_BAD_FLAG))
            if action_for(WORKER_UNREACHABLE) not in ("Ignore", "Count"):
                fail("%s: podFailurePolicy does not retry exit %d (ps-worker: the servers did not answer)"
                     % (n, WORKER_UNREACHABLE))


def job_of(objs, servers):
    """The job file the servers read: the ConfigMap key their --job names."""
    o, c, ps, runs = servers[0]
    path = runs[0][2].get("--job", "")
    m = mount_for(c, path)
    vol = {v["name"]: v for v in ps.get("volumes") or []}.get(m["name"]) if m else None
    if not vol or "configMap" not in vol:
        return None
    cm = next(x for x in objs if x["kind"] == "ConfigMap" and x["metadata"]["name"] == vol["configMap"]["name"])
    return json.loads(cm["data"][path[len(m["mountPath"].rstrip("/")) + 1:]])


# ---------------------------------------------------------------- main
SOURCE_JOB = os.path.join(root, "deploy", "jobs", "fashion_mnist_cnn.json")
with open(SOURCE_JOB, "rb") as f:
    source_job_bytes = f.read()
source_job = json.loads(source_job_bytes)
for copy_path in ("base/job.json",):
    with open(os.path.join(root, "deploy", "k8s", copy_path), "rb") as f:
        if f.read() != source_job_bytes:
            fail("deploy/k8s/%s differs from deploy/jobs/fashion_mnist_cnn.json, which it copies: "
                 "cp deploy/jobs/fashion_mnist_cnn.json deploy/k8s/%s" % (copy_path, copy_path))
with open(os.path.join(root, "deploy", "k8s", "elastic", "job.json")) as f:
    ejob = json.load(f)
if not isinstance(ejob.get("lease_chunk"), int) or ejob["lease_chunk"] <= 0:
    fail("deploy/k8s/elastic/job.json: no positive lease_chunk")
if {k: v for k, v in ejob.items() if k != "lease_chunk"} != source_job:
    fail("deploy/k8s/elastic/job.json differs from deploy/jobs/fashion_mnist_cnn.json by more than lease_chunk")

# No Secret values in the manifests; the generators' files are ignored by git.
in_git = subprocess.run(["git", "-C", root, "rev-parse", "--is-inside-work-tree"],
                        capture_output=True, text=True).stdout.strip() == "true"
for path in sorted(glob.glob(os.path.join(root, "deploy", "k8s", "**", "*.y*ml"), recursive=True)):
    rel = os.path.relpath(path, root)
    if "/secrets/" in rel:
        continue
    for d in load_docs(path):
        if isinstance(d, dict) and d.get("kind") == "Secret":
            fail("%s: a Secret in a manifest (secretGenerator makes them from files)" % rel)
        if isinstance(d, dict) and d.get("kind") == "Kustomization":
            for g in d.get("secretGenerator", []):
                for src in g.get("files", []):
                    p = os.path.join(os.path.dirname(rel), src.partition("=")[2] or src)
                    if in_git and subprocess.run(["git", "-C", root, "check-ignore", "-q", p]).returncode != 0:
                        fail("%s: secretGenerator %s reads %s, which git does not ignore" % (rel, g["name"], p))
                    # A dummy for the rendering, in the copy.
                    dummy = os.path.join(tmp, "tree", p)
                    os.makedirs(os.path.dirname(dummy), exist_ok=True)
                    if not os.path.exists(dummy):
                        with open(dummy, "w") as fh:
                            fh.write("dummy-%s-0123456789abcdef\n" % os.path.basename(p))

VARIANTS = [("deploy/k8s", ""), ("deploy/k8s/overlays/gpu", "overlays/gpu"),
            ("deploy/k8s/overlays/shared-checkpoints", "overlays/shared-checkpoints"),
            ("deploy/k8s/elastic", "elastic")]
total = 0
for label, sub in VARIANTS:
    d = os.path.join(k8s, sub)
    try:
        objs, _, _ = render(d)
    except (Refused, OSError, KeyError, IndexError, ValueError, yaml.YAMLError) as e:
        fail("%s: the test's renderer: %s" % (label, e))
        continue
    if kustomize:
        out = subprocess.run(kustomize + [d], capture_output=True, text=True)
        if out.returncode != 0:
            fail("%s: %s fails: %s" % (label, " ".join(kustomize), out.stderr.strip()))
        else:
            theirs = unhash([x for x in yaml.safe_load_all(out.stdout) if x])
            ours = unhash(objs)
            if json.dumps(theirs, sort_keys=True) != json.dumps(ours, sort_keys=True):
                diff = difflib.unified_diff(yaml.safe_dump_all(theirs).splitlines(),
                                            yaml.safe_dump_all(ours).splitlines(),
                                            " ".join(kustomize), "the test's renderer", lineterm="")
                fail("%s: the test's renderer and %s differ (hashes aside):\n%s"
                     % (label, " ".join(kustomize), "\n".join(diff)))
    total += len(objs)
    servers, workers = check_variant(label, objs)
    kinds = sorted("%s/%s" % (o["kind"], o["metadata"]["name"]) for o in objs)
    print("%s: %d objects: %s" % (label, len(objs), " ".join(kinds)))
    worker_objs = [(o, c) for o, c, _, runs in workers if not any("--evaluator" in r[2] for r in runs)]
    gpus = [(o, c) for o, c in worker_objs
            if "nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {})]
    if sub == "overlays/gpu":
        for o, c, _, runs in workers:
            if any("--evaluator" in r[2] for r in runs):
                continue
            n = "%s: %s %s" % (label, o["kind"], o["metadata"]["name"])
            res = c.get("resources") or {}
            lim = (res.get("limits") or {}).get("nvidia.com/gpu")
            req = (res.get("requests") or {}).get("nvidia.com/gpu", lim)
            if lim is None or quantity(lim) < 1 or str(req) != str(lim):
                fail("%s: does not request nvidia.com/gpu (limits %s, requests %s)" % (n, lim, req))
            for pod, argv, opts, _ in runs:
                if not re.fullmatch(r"cuda(:[0-9]+)?", str(opts.get("--device"))):
                    fail("%s (pod %s): --device %s, not cuda" % (n, pod["name"], opts.get("--device")))
    elif gpus:
        fail("%s: workers request nvidia.com/gpu outside overlays/gpu" % label)
    for o, c, _, _ in servers:
        if "nvidia.com/gpu" in ((c.get("resources") or {}).get("limits") or {}):
            fail("%s: the servers request a GPU" % label)
    if servers:
        job = job_of(objs, servers)
        if job is None:
            fail("%s: the servers' --job is not a key of a ConfigMap" % label)
        elif sub == "elastic":
            if not job.get("lease_chunk"):
                fail("%s: the servers' job has no lease_chunk: elastic workers need data leases" % label)
            if any(o["kind"] == "Job" and o["spec"].get("completionMode") == "Indexed" for o, _, _, _ in workers):
                fail("%s: the Indexed Job of workers is still there" % label)
            if not any(o["kind"] == "Deployment" for o, _, _, _ in workers):
                fail("%s: no Deployment of workers" % label)
        elif job != source_job:
            fail("%s: the servers' job is not deploy/jobs/fashion_mnist_cnn.json" % label)
        sts = servers[0][0]
        if sub == "overlays/shared-checkpoints":
            if sts["spec"].get("volumeClaimTemplates"):
                fail("%s: the StatefulSet still has volumeClaimTemplates" % label)
            vol = next((v for v in sts["spec"]["template"]["spec"].get("volumes") or []
                        if v["name"] == "checkpoints"), {})
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            pvc = next((x for x in objs if x["kind"] == "PersistentVolumeClaim"
                        and x["metadata"]["name"] == claim), None)
            if pvc is None or "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
                fail("%s: the checkpoints volume is not a ReadWriteMany claim" % label)

if failures:
    print("%d check(s) failed" % len(failures), file=sys.stderr)
    sys.exit(1)
print("kubernetes-validate --strict: %d objects in %d renderings pass (Kubernetes 1.30 and %s)%s"
      % (total, len(VARIANTS), kubernetes_validate.utils.latest_version(),
         "; the renderer agrees with " + " ".join(kustomize) if kustomize else
         "; no kustomize here to compare the renderer with"))
PY
echo "PASS: deploy/k8s"
