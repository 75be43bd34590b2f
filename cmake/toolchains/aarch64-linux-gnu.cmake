# Cross-compiling for 64-bit ARM Linux with Debian's cross toolchain (g++-aarch64-linux-gnu); the
# tests run under qemu's user-mode emulator (qemu-user). The library has no ARM kernels: this
# build checks the portable kernel set, the only one there, compiles without warnings and
# computes what the x86 sets compute (the aarch64 preset).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
# Programs and libraries of the target only; headers and CMake packages may also be the build
# machine's, which is right for the header-only, architecture-independent Eigen and xxHash.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
