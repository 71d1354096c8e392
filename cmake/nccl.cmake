# NCCL for the sharded CUDA plan's NCCL transport (src/cuda/sharded/comm_nccl.cu), -DEKV_NCCL=ON:
# from NCCL_ROOT (a CMake or environment variable), else the folder of the pip package
# nvidia-nccl-cu12 (what torch installs: nvidia/nccl/{include,lib}), else the system paths.
set(_ekv_nccl_hints)
if(DEFINED NCCL_ROOT)
  list(APPEND _ekv_nccl_hints ${NCCL_ROOT})
endif()
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _ekv_nccl_hints $ENV{NCCL_ROOT})
endif()
find_program(_ekv_python NAMES python3 python)
if(_ekv_python)
  execute_process(COMMAND ${_ekv_python} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
                  OUTPUT_VARIABLE _ekv_pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_ekv_pip_nccl)
    list(APPEND _ekv_nccl_hints ${_ekv_pip_nccl})
  endif()
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_ekv_nccl_hints} PATH_SUFFIXES include)
# the pip package ships libnccl.so.2 only (no unversioned link)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_ekv_nccl_hints} PATH_SUFFIXES lib lib64)
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  message(FATAL_ERROR "EKV_NCCL=ON: nccl.h / libnccl not found (set NCCL_ROOT, or pip install "
                      "nvidia-nccl-cu12); searched: ${_ekv_nccl_hints}")
endif()
message(STATUS "entmaxkv: NCCL ${NCCL_LIBRARY} (${NCCL_INCLUDE_DIR})")
target_include_directories(entmaxkv PRIVATE ${NCCL_INCLUDE_DIR})
target_link_libraries(entmaxkv PRIVATE ${NCCL_LIBRARY})
set_source_files_properties(src/cuda/sharded/comm_nccl.cu PROPERTIES COMPILE_DEFINITIONS EKV_NCCL=1)
