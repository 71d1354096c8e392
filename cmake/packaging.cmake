# What a user links against after `cmake --install`: entmaxkv.pc for pkg-config and the
# entmaxkv::entmaxkv target for find_package(entmaxkv). Included by the top CMakeLists.txt.

# pkg-config: a static libentmaxkv.a carries none of its own dependencies, and the documented
# `pkg-config --cflags --libs entmaxkv` (without --static) only prints Libs, so for the static
# library libm, threads (and the CUDA runtime) go into Libs. The shared library records them
# itself (DT_NEEDED), so there they are only Libs.private.
# (CMAKE_THREAD_LIBS_INIT is empty where libc has the threads, else -lpthread or -pthread)
set(EKV_PC_DEPS -lm ${CMAKE_THREAD_LIBS_INIT})
set(EKV_PC_CFLAGS "")
if(EKV_CUDA)
  # nvcc objects call the CUDA runtime and the C++ runtime of the host compiler
  list(APPEND EKV_PC_DEPS -L${CUDAToolkit_LIBRARY_DIR} -lcudart -lcublas -lstdc++)
  set(EKV_PC_CFLAGS " -DEKV_HAVE_CUDA=1")
endif()
list(JOIN EKV_PC_DEPS " " EKV_PC_DEPS)
if(BUILD_SHARED_LIBS)
  set(EKV_PC_LIBS "-lentmaxkv")
  set(EKV_PC_LIBS_PRIVATE "${EKV_PC_DEPS}")
else()
  set(EKV_PC_LIBS "-lentmaxkv ${EKV_PC_DEPS}")
  set(EKV_PC_LIBS_PRIVATE "")
endif()
file(RELATIVE_PATH EKV_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(${CMAKE_CURRENT_LIST_DIR}/entmaxkv.pc.in ${CMAKE_CURRENT_BINARY_DIR}/entmaxkv.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/entmaxkv.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# CMake package: exported targets, a config that finds the dependencies the exported target
# names (Threads, and CUDAToolkit for a CUDA build), and a version file (0.x: same minor).
include(CMakePackageConfigHelpers)
set(EKV_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/entmaxkv)
install(EXPORT entmaxkvTargets NAMESPACE entmaxkv:: DESTINATION ${EKV_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/entmaxkvConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/entmaxkvConfig.cmake INSTALL_DESTINATION ${EKV_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/entmaxkvConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/entmaxkvConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/entmaxkvConfigVersion.cmake DESTINATION ${EKV_CMAKE_DIR})
