# Click-through data: the Criteo TSV reader and the synthetic click logs
# (worker/data/data_ctr.c), ROC AUC and log-loss (common/auc.c), the generator
# program ps-ctr-gen and their unit test.
target_sources(ps_workerlib PRIVATE ${CMAKE_SOURCE_DIR}/worker/data/data_ctr.c
                                    ${CMAKE_SOURCE_DIR}/common/auc.c)
add_executable(ps-ctr-gen tools/ctr_gen/ctr_gen_main.c)
target_link_libraries(ps-ctr-gen ps_workerlib)
ps_unit_test(test_ctr_data ps_workerlib)
# Installed beside the other programs (bin/). GNUInstallDirs is included
# further down the main CMakeLists too; including it here first is harmless.
include(GNUInstallDirs)
install(TARGETS ps-ctr-gen RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
