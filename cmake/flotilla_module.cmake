# flotilla_module(<name> SOURCES ... [USES <module>...] [LIBS <target>...] [PRIVATE_LIBS ...]
#                 [TORCH])
#
# One static library per module, flotilla_<name>, that can see exactly what the layering allows:
#   - its own public headers, include/flotilla/<name>/, and those of the modules it USES (and,
#     through them, what they use): each module's public include directory is a view holding
#     that module's folder alone, so an #include "flotilla/<other>/..." of a module it does not
#     use finds no file and the build stops there;
#   - its own private headers, src/<name>/..., included as "<name>/...": a private view that
#     no other module's target has.
# TORCH: the module uses LibTorch (and the shared precompiled <torch/torch.h>); base and
# cluster do not, and compile without it.
function(flotilla_module name)
  cmake_parse_arguments(M "TORCH" "" "SOURCES;USES;LIBS;PRIVATE_LIBS" ${ARGN})
  set(target flotilla_${name})
  add_library(${target} STATIC ${M_SOURCES})
  add_library(flotilla::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  set(views ${CMAKE_BINARY_DIR}/include-views)
  set(public ${views}/${name})
  set(private ${views}/${name}-private)
  file(MAKE_DIRECTORY ${public}/flotilla ${private})
  if(IS_DIRECTORY ${CMAKE_SOURCE_DIR}/include/flotilla/${name})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/include/flotilla/${name} ${public}/flotilla/${name}
      SYMBOLIC)
  endif()
  file(CREATE_LINK ${CMAKE_SOURCE_DIR}/src/${name} ${private}/${name} SYMBOLIC)
  target_include_directories(${target}
    PUBLIC $<BUILD_INTERFACE:${public}> $<INSTALL_INTERFACE:include>
    PRIVATE ${private})
  set(uses)
  foreach(module IN LISTS M_USES)
    list(APPEND uses flotilla_${module})
  endforeach()
  target_link_libraries(${target} PUBLIC ${uses} ${M_LIBS} PRIVATE ${M_PRIVATE_LIBS})
  target_compile_options(${target} PRIVATE ${FLOTILLA_WARNINGS})
  target_compile_features(${target} PUBLIC cxx_std_17)
  if(M_TORCH)
    target_link_libraries(${target} PUBLIC ${FLOTILLA_TORCH_TARGETS})
    target_precompile_headers(${target} REUSE_FROM flotilla_pch)
  endif()
  set_property(GLOBAL APPEND PROPERTY FLOTILLA_MODULES ${target})
endfunction()
