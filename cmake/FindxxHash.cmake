# FindxxHash: the xxHash headers (Debian: libxxhash-dev), used header-only with XXH_INLINE_ALL,
# so the imported target carries the include directory and nothing to link. Debian's package
# ships no CMake config; a newer xxHash that does ships its own xxHash::xxhash, which works too.
#   xxHash_FOUND, xxHash_VERSION, xxHash_INCLUDE_DIR; target xxHash::xxhash
find_path(xxHash_INCLUDE_DIR NAMES xxhash.h)
if(xxHash_INCLUDE_DIR AND EXISTS "${xxHash_INCLUDE_DIR}/xxhash.h")
  file(STRINGS "${xxHash_INCLUDE_DIR}/xxhash.h" _xxhash_version_lines
       REGEX "^#define XXH_VERSION_(MAJOR|MINOR|RELEASE)[ \t]+[0-9]+")
  foreach(part IN ITEMS MAJOR MINOR RELEASE)
    string(REGEX REPLACE ".*#define XXH_VERSION_${part}[ \t]+([0-9]+).*" "\\1" _xxhash_${part}
           "${_xxhash_version_lines}")
  endforeach()
  set(xxHash_VERSION "${_xxhash_MAJOR}.${_xxhash_MINOR}.${_xxhash_RELEASE}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(xxHash REQUIRED_VARS xxHash_INCLUDE_DIR
                                  VERSION_VAR xxHash_VERSION)
mark_as_advanced(xxHash_INCLUDE_DIR)

if(xxHash_FOUND AND NOT TARGET xxHash::xxhash)
  add_library(xxHash::xxhash INTERFACE IMPORTED)
  set_target_properties(xxHash::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES
                                                  "${xxHash_INCLUDE_DIR}")
endif()
