# td_add_test(NAME SOURCES src... LIBS lib... LABELS label...)
# One Criterion binary per module, registered with ctest under its labels.
function(td_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  # Under ThreadSanitizer only the multi-threaded tests (label threads) are
  # built and registered, over a stand-in for Criterion (TD_CRITERION,
  # tests/lib/tsan); the others stay targets, for the settings made on them.
  if(TD_TSAN AND NOT "threads" IN_LIST T_LABELS)
    add_executable(${name} EXCLUDE_FROM_ALL ${T_SOURCES})
    return()
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${TD_CRITERION} ${T_LIBS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/lib)
  target_compile_definitions(${name} PRIVATE
    TENSORD_BIN="$<TARGET_FILE:tensord>"
    TENSORCTL_BIN="$<TARGET_FILE:tensorctl>")
  add_test(NAME ${name} COMMAND ${name} --jobs 2 --timeout 60)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}"
                       TIMEOUT ${T_TIMEOUT})
  # The same integration tests with every tensord under valgrind (ctest -L
  # valgrind): the daemon must exit 0 with no error and no leak.
  if(TD_VALGRIND AND "integration" IN_LIST T_LABELS)
    add_test(NAME ${name}_valgrind COMMAND ${name} --jobs 1 --timeout 600)
    set_tests_properties(${name}_valgrind PROPERTIES LABELS "valgrind"
      TIMEOUT 1800 ENVIRONMENT
      "TDT_DAEMON_WRAPPER=valgrind --quiet --leak-check=full --show-leak-kinds=definite,indirect --errors-for-leak-kinds=definite,indirect --error-exitcode=99 --trace-children=no")
  endif()
  # A race report fails the test it shows in (halt_on_error), tensord's as
  # well as the test's own.
  if(TD_TSAN)
    set_tests_properties(${name} PROPERTIES ENVIRONMENT
      "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1")
  endif()
  if(TD_SANITIZE)
    set_tests_properties(${name} PROPERTIES ENVIRONMENT
      "LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/lsan.supp:print_suppressions=0;UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
  endif()
endfunction()
