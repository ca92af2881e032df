#!/usr/bin/env python3
"""Which library each program of a GPU bundle loads, and from where, as the dynamic loader of a
machine that has none of this project's dependencies would find it.

For every program in BUNDLE/bin it follows DT_NEEDED from the program through every library it
loads, and resolves each name the way ld.so does on such a machine: first the DT_RPATH of the
object that needs it and of the objects that loaded it (only while none of them has a
DT_RUNPATH), then LD_LIBRARY_PATH (here: nothing but the CUDA libraries' folders, as
tests/gpu/on_device.sh sets it), then the DT_RUNPATH of the object that needs it, and of that
object alone ($ORIGIN expanded) -- the rule that lets a program find its own libraries through
its RUNPATH and its libraries' libraries not. A name found inside the bundle is fine. A name
not found there must be on SYSTEM (the C runtime, which every Linux has) or CUDA (the GPU
machine's own libraries); anything else is a library the bundle lacks: reported with the chain
of objects that needs it, and the exit status is 1.

  tests/gpu/bundle_libs.py BUNDLE_DIR      (an unpacked bundle: bin/ and lib/)

Reads ELF headers with readelf (binutils); the standard library otherwise."""
import os
import re
import subprocess
import sys

# Present on any glibc Linux: never packed.
SYSTEM = [r"libc\.so\.6", r"libm\.so\.6", r"libdl\.so\.2", r"libpthread\.so\.0", r"librt\.so\.1",
          r"ld-linux-x86-64\.so\.2", r"libstdc\+\+\.so\.6", r"libgcc_s\.so\.1",
          r"libresolv\.so\.2", r"libutil\.so\.1"]
# The GPU machine's: the driver and CUDA's libraries (the runtime is linked statically).
CUDA = [r"libcuda\.so\.1", r"libcublas\.so\.\d+", r"libcublasLt\.so\.\d+", r"libcudnn\w*\.so\.\d+",
        r"libnccl\.so\.\d+", r"libnvrtc[\w.-]*\.so[\d.]*", r"libcufft\.so\.\d+"]


def dynamic(path):
    """(NEEDED list, RPATH list, RUNPATH list or None) of an ELF file."""
    out = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    rpath = re.findall(r"\(RPATH\)\s+Library rpath: \[([^\]]*)\]", out)
    runpath = re.findall(r"\(RUNPATH\)\s+Library runpath: \[([^\]]*)\]", out)
    origin = os.path.dirname(os.path.abspath(path))
    split = lambda s: [d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
                       for d in s.split(":") if d]
    return (needed, [d for s in rpath for d in split(s)],
            [d for s in runpath for d in split(s)] if runpath else None)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    bundle = os.path.abspath(sys.argv[1])
    bins = sorted(os.listdir(os.path.join(bundle, "bin")))
    ld_library_path = [d for d in os.environ.get("PS_BUNDLE_LD_LIBRARY_PATH", "").split(":") if d]
    system = re.compile("^(" + "|".join(SYSTEM) + ")$")
    cuda = re.compile("^(" + "|".join(CUDA) + ")$")
    inside = lambda p: os.path.abspath(p).startswith(bundle + os.sep)
    bad, used = 0, {}
    for prog in bins:
        root = os.path.join(bundle, "bin", prog)
        # Breadth first, as ld.so loads: (object path, the objects that loaded it, nearest last).
        queue, seen = [(root, [])], {}
        while queue:
            obj, loaders = queue.pop(0)
            needed, rpath, runpath = dynamic(obj)
            # Without a DT_RUNPATH of its own, an object's names are looked up in its DT_RPATH
            # and in those of the objects that loaded it, up to the program.
            rpaths = []
            if runpath is None:
                rpaths = list(rpath)
                for anc in reversed(loaders):
                    rpaths += dynamic(anc)[1]
            chain = [os.path.basename(x) for x in loaders + [obj]]
            for name in needed:
                if name in seen:
                    continue
                where = None
                for d in rpaths + ld_library_path + (runpath or []):
                    cand = os.path.join(d, name)
                    if os.path.exists(cand) and inside(cand):
                        where = cand
                        break
                if where:
                    seen[name] = os.path.relpath(where, bundle)
                    queue.append((where, loaders + [obj]))
                elif system.match(name):
                    seen[name] = "system"
                elif cuda.match(name):
                    seen[name] = "CUDA (the GPU machine's)"
                else:
                    seen[name] = None
                    bad += 1
                    print(f"bundle_libs: {prog}: {name} is not in the bundle where the loader looks "
                          f"(needed by {' -> '.join(chain)}), nor a system or CUDA library")
        used[prog] = seen
        inb = sum(1 for v in seen.values() if v and v.startswith("lib/"))
        print(f"bundle_libs: {prog}: {len(seen)} libraries: {inb} from the bundle, "
              f"{sum(1 for v in seen.values() if v == 'system')} system, "
              f"{sum(1 for v in seen.values() if v and v.startswith('CUDA'))} CUDA"
              + (f", {sum(1 for v in seen.values() if v is None)} MISSING" if None in seen.values() else ""))
    packed = set(os.listdir(os.path.join(bundle, "lib")))
    unused = packed - {os.path.basename(v) for s in used.values() for v in s.values() if v}
    if unused:
        print(f"bundle_libs: packed but loaded by no program: {', '.join(sorted(unused))}")
    print(f"bundle_libs: {len(bins)} programs, {len(packed)} packed libraries, {bad} missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
