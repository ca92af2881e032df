#!/usr/bin/env python3
"""Reads what compute-sanitizer printed for one program and tells the reports the kit expects from
the ones it does not, on one line; exits 1 when there is any unexpected report, or when the
program itself failed.

A report is a record that starts with "========= " and a word (the lines indented further belong
to it): an API error ("Program hit cudaErrorMemoryAllocation ... on CUDA API call to
cudaMalloc"), an invalid access, a race ("Error: Race reported between ..."), a barrier error.
Expected:
  - memcheck: cudaErrorMemoryAllocation on cudaMalloc in a host backtrace through
    test_memory_helpers: test_cuda_parity asks for 2^60 bytes on purpose, to check the refusal;
  - racecheck: a hazard inside a kernel of cuBLAS (its name starts with nvjet, sm90_xmma, sm80_xmma,
    ampere_, cutlass, gemm or sgemm) that the same tool also reports for cuBLAS alone
    (--library LOG: the output for tests/gpu/cublas_race, which calls cuBLAS as the backend does
    with nothing of this project around it): cuBLAS's own, not the project's.
Everything else is unexpected.

  tests/gpu/sanitizer_report.py TOOL NAME LOG EXIT [--library LOG]
     TOOL memcheck|racecheck|synccheck|initcheck, NAME what ran (for the line), LOG its output,
     EXIT the exit status of the sanitized program (compute-sanitizer run without --error-exitcode).
Standard library only."""
import re
import sys

CUBLAS_KERNEL = re.compile(r"^(nvjet|sm\d+_xmma|ampere_|cutlass|gemm|sgemm|void gemm|void cutlass)")


def reports(text):
    """The records of a compute-sanitizer output: a list of (head, body lines)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^========= (\S.*)$", line)
        if m:
            head = m.group(1)
            if re.match(r"(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                        r"Target application returned|This program)", head):
                continue
            out.append([head, []])
        elif line.startswith("=========") and out:
            out[-1][1].append(line[9:].strip())
    return out


def kernel_of(head, body):
    """The kernel a report is in, as compute-sanitizer names it (or '')."""
    for text in [head] + body:
        # "... at 0x6360 in file.cu:123:kernel(args)" or "... at 0x1fe0 in kernel [32 hazards]"
        m = re.search(r"\bat 0x[0-9a-f]+ in (?:\S+?:\d+:)?([A-Za-z_][\w:<>, ]*?)(?:\(|\s\[|$)", text)
        if m:
            return m.group(1).strip()
    return ""


def classify(tool, head, body, library_kernels):
    """(expected?, why) for one report."""
    text = "\n".join([head] + body)
    if tool == "memcheck" and "cudaErrorMemoryAllocation" in head and "cudaMalloc" in head \
            and re.search(r"Host Frame:\s*test_memory_helpers", text):
        return True, "the 2^60-byte allocation test_cuda_parity refuses on purpose"
    if tool == "racecheck" and re.search(r"(Race|Hazard)", head):
        k = kernel_of(head, body)
        if k and CUBLAS_KERNEL.match(k) and k in library_kernels:
            return True, f"inside cuBLAS's {k}, reported for cuBLAS alone too"
        if k and CUBLAS_KERNEL.match(k):
            return False, f"inside cuBLAS's {k}, not reported for cuBLAS alone"
    return False, head


def main(argv):
    if len(argv) < 5:
        print(__doc__.strip().splitlines()[-4].strip(), file=sys.stderr)
        return 2
    tool, name, log, status = argv[1], argv[2], argv[3], int(argv[4])
    library = argv[argv.index("--library") + 1] if "--library" in argv else None
    text = open(log, errors="replace").read()
    library_kernels = set()
    if library:
        for h, b in reports(open(library, errors="replace").read()):
            k = kernel_of(h, b)
            if k:
                library_kernels.add(k)
    expected, unexpected = [], []
    for head, body in reports(text):
        ok, why = classify(tool, head, body, library_kernels)
        (expected if ok else unexpected).append(why)
    # A race report counts its hazards ("[32 hazards]"): said as the tool says it.
    what = f"{tool} {name}: {len(unexpected)} unexpected report(s)"
    if expected:
        kinds = sorted(set(expected))
        what += f", {len(expected)} expected ({'; '.join(kinds)})"
    if unexpected:
        what += ": " + " | ".join(sorted(set(unexpected))[:3])
    if status not in (0, 77) and not unexpected:
        what += f"; but the program exited {status}"
    print(what)
    return 1 if unexpected or status not in (0, 77) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
