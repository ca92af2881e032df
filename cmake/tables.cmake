# Embedding tables on the shards (ps/state/table.c) and their tests.
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/state/table.c)
ps_unit_test(test_table ps_shardlib)
# Their rows in checkpoints (ps/ckpt/table_ckpt.c): saved, restored onto any
# number of shards, exported as .npy.
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/ckpt/table_ckpt.c)
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
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/state/table_sync.c)
ps_unit_test(test_table_sync ps_shardlib)
if(EXISTS ${CMAKE_SOURCE_DIR}/tests/integration/table_sync_check.c)
  add_executable(table_sync_check tests/integration/table_sync_check.c)
  target_link_libraries(table_sync_check ps_workerlib Threads::Threads)
endif()
