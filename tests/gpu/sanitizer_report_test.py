#!/usr/bin/env python3
"""tests/gpu/sanitizer_report.py on compute-sanitizer outputs written in its formats (API errors,
invalid accesses, races with and without line information): the deliberate refusal and cuBLAS's
own hazards are expected, everything else is not, and a program that failed fails the part."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "sanitizer_report.py")
B = "========="

OOM = f"""{B} COMPUTE-SANITIZER
{B} Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaMalloc.
{B}     Saved host backtrace up to driver entry point at error
{B}     Host Frame: [0x419b65]
{B}                in /usr/lib/x86_64-linux-gnu/libcuda.so.1
{B}     Host Frame:cudaMalloc [0xff589]
{B}                in /tmp/ps-gpu/bin/test_cuda_parity
{B}     Host Frame:ps_cuda_alloc [0x89117]
{B}                in /tmp/ps-gpu/bin/test_cuda_parity
{B}     Host Frame:test_memory_helpers [0x4170b]
{B}                in /tmp/ps-gpu/bin/test_cuda_parity
{B}     Host Frame:main [0x185eb]
{B}                in /tmp/ps-gpu/bin/test_cuda_parity
{B} 
"""
OOM_ELSEWHERE = OOM.replace("test_memory_helpers", "ps_model_create")
INVALID = f"""{B} Invalid __global__ write of size 4 bytes
{B}     at relu_forward_kernel(unsigned long, const float *, float *)+0x120
{B}     by thread (0,0,0) in block (0,0,0)
{B}     Access to 0x147267fff80 is out of bounds
{B} 
"""
RACE = f"""{B} Error: Race reported between Read access at 0x5f30 in nvjet_sm90_tss_64x32_64x16_2x2_h_bx_splitK_TNT
{B}     and Write access at 0x6a10 in nvjet_sm90_tss_64x32_64x16_2x2_h_bx_splitK_TNT [32 hazards]
{B} 
"""
RACE_OURS = f"""{B} ERROR: Race reported between Read access at 0x6360 in /src/kernels/cuda/ops_cuda.cu:123:sum_rows_kernel(int, int, const float *, float *)
{B}     and Write access at 0x1fe0 in /src/kernels/cuda/ops_cuda.cu:63:sum_rows_kernel(int, int, const float *, float *) [64 hazards]
{B} 
"""
END = f"{B} ERROR SUMMARY: 0 errors\n"


def run(tool, text, status, library=None):
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log")
        open(log, "w").write(text)
        args = [sys.executable, TOOL, tool, "test_cuda_parity", log, str(status)]
        if library is not None:
            lib = os.path.join(d, "lib")
            open(lib, "w").write(library)
            args += ["--library", lib]
        p = subprocess.run(args, capture_output=True, text=True)
        return p.returncode, p.stdout.strip()


fails = 0


def expect(name, got, rc, words):
    global fails
    ok = got[0] == rc and all(w in got[1] for w in words)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {got[0]}: {got[1]}")
    fails += not ok


expect("clean", run("memcheck", f"{B} COMPUTE-SANITIZER\n" + END, 0), 0, ["0 unexpected"])
expect("the deliberate refusal", run("memcheck", OOM + END, 0), 0,
       ["0 unexpected", "1 expected", "refuses on purpose"])
expect("a refusal elsewhere", run("memcheck", OOM_ELSEWHERE + END, 0), 1, ["1 unexpected"])
expect("an invalid write beside the refusal", run("memcheck", OOM + INVALID + END, 0), 1,
       ["1 unexpected", "1 expected", "Invalid __global__ write"])
expect("cuBLAS's hazard, also for cuBLAS alone", run("racecheck", RACE + END, 0, RACE), 0,
       ["0 unexpected", "1 expected", "nvjet_sm90_tss_64x32_64x16_2x2_h_bx_splitK_TNT"])
expect("cuBLAS's hazard, not for cuBLAS alone", run("racecheck", RACE + END, 0, END), 1,
       ["1 unexpected", "not reported for cuBLAS alone"])
expect("cuBLAS's hazard, no evidence run", run("racecheck", RACE + END, 0), 1, ["1 unexpected"])
expect("a hazard in the project's kernel", run("racecheck", RACE_OURS + END, 0, RACE), 1,
       ["1 unexpected", "Race reported"])
expect("no report, but the program failed", run("memcheck", END, 1), 1, ["exited 1"])
expect("skipped (no device) is not a failure", run("memcheck", END, 77), 0, ["0 unexpected"])
print(f"sanitizer_report_test: {10 - fails} passed, {fails} failed")
sys.exit(1 if fails else 0)
