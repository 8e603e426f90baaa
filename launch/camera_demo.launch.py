"""ros2 launch kaitian_ros camera_demo.launch.py [rate_hz:=30.0]

The node graph and every parameter come from config/camera_demo.yaml, the same file
`kaitian launch camera_demo` reads; launch arguments left unset keep the file's values.
Shared logic: kaitian_ros/ros_launch.py.
"""

from kaitian_ros.ros_launch import launch_description

SCENARIO = "camera_demo"


def generate_launch_description():
    return launch_description(SCENARIO)
