# Helpers shared by the module CMakeLists files.

# pdserve_library(NAME SOURCES... [LINK libs...]): a static library of project
# code, registered so that the pdserve binary and every test link it.
function(pdserve_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LINK" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_link_libraries(${name} PUBLIC pdserve_settings ${ARG_LINK})
  set_property(GLOBAL APPEND PROPERTY PDSERVE_LIBS ${name})
endfunction()

# Adds every sub-folder of the current folder that has a CMakeLists.txt, in
# the order given, skipping absent ones (modules grow one folder at a time).
function(pdserve_add_subdirs)
  foreach(sub ${ARGN})
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${sub}/CMakeLists.txt)
      add_subdirectory(${sub})
    endif()
  endforeach()
endfunction()
