# Read by ctest (tests/CMakeLists.txt adds it to TEST_INCLUDE_FILES after gtest_discover_tests'
# own file, which sets rig_tests_TESTS to the discovered names): the slow multi-rank tests of
# rig_tests get the label `slow` besides `unit`, so that a developer can skip them:
#   ctest -LE slow          (everything else)        ctest -L slow          (only them)
# CI runs every test. A test belongs here when it trains or launches several ranks (threads or
# processes) and takes seconds: the suites below, as gtest names them (parameterised suites
# carry an instance prefix, "Strategies/ParallelEquivalence.X/ddp").
set(rig_slow_tests_regex "^(Parallel|GuardParallel|DistLaunch|DistBench)\\.|/ParallelEquivalence\\.")
foreach(rig_test IN LISTS rig_tests_TESTS)
  if(rig_test MATCHES "${rig_slow_tests_regex}")
    set_tests_properties("${rig_test}" PROPERTIES LABELS "unit;slow")
  endif()
endforeach()
