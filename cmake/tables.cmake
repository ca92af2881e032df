# Embedding tables on the shards (ps/table.c) and their tests.
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/table.c)
# Its scans of pushed values (largest magnitude, NaN/Inf) run over every
# value of a push:
# GCC's -O2 cost model ("very cheap") leaves them scalar, "cheap"
# vectorizes them (unit.table_vectorized).
if(CMAKE_C_COMPILER_ID STREQUAL "GNU")
  set_source_files_properties(ps/table.c PROPERTIES COMPILE_OPTIONS -fvect-cost-model=cheap)
endif()
ps_unit_test(test_table ps_shardlib)
# Their rows in checkpoints (ps/table_ckpt.c): saved, restored onto any
# number of shards, exported as .npy.
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/table_ckpt.c)
ps_unit_test(test_table_ckpt ps_shardlib)
if(EXISTS ${CMAKE_SOURCE_DIR}/tests/integration/table_check.c)
  add_executable(table_check tests/integration/table_check.c)
  target_link_libraries(table_check ps_workerlib)
endif()
if(EXISTS ${CMAKE_SOURCE_DIR}/tests/bench/bench_rows.c)
  add_executable(bench_rows tests/bench/bench_rows.c)
  target_link_libraries(bench_rows ps_workerlib)
endif()
# Sync steps' embedding rows (a sparse sum beside the dense one).
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/table_sync.c)
ps_unit_test(test_table_sync ps_shardlib)
if(EXISTS ${CMAKE_SOURCE_DIR}/tests/integration/table_sync_check.c)
  add_executable(table_sync_check tests/integration/table_sync_check.c)
  target_link_libraries(table_sync_check ps_workerlib Threads::Threads)
endif()
# ps/table.c's marked loops vectorized at -O2 and -O3 (GCC's own reports).
add_test(NAME unit.table_vectorized
         COMMAND bash ${CMAKE_SOURCE_DIR}/tests/bench/check_vectorized.sh ${CMAKE_BINARY_DIR}
                 ps/table.c 1)
set_tests_properties(unit.table_vectorized PROPERTIES TIMEOUT 120 LABELS unit
                     SKIP_RETURN_CODE 77)
