# Embedding tables on the shards (ps/table.c) and their tests.
target_sources(ps_shardlib PRIVATE ${CMAKE_SOURCE_DIR}/ps/table.c)
ps_unit_test(test_table ps_shardlib)
