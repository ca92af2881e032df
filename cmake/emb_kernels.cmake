# The embedding (click-through-rate) kernels: the host plan that
# de-duplicates a batch's ids (kernels/emb_plan.c) joins the kernels
# library, and its test covers the plan and the embedding ops of the cpu
# and emulated backends (test_cuda_parity covers the CUDA ones).
target_sources(ps_kernels PRIVATE ${CMAKE_SOURCE_DIR}/kernels/emb_plan.c)
ps_unit_test(test_emb_kernels ps_kernels ps_spec ps_util)
