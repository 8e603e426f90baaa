"""ros2 launch kaitian_ros hetero_training.launch.py [ranks:=3 policy:=adaptive]

The node graph and every parameter come from config/hetero_training.yaml, the same file
`kaitian launch hetero_training` reads; launch arguments left unset keep the file's values.
Shared logic: kaitian_ros/ros_launch.py.
"""

from kaitian_ros.ros_launch import launch_description

SCENARIO = "hetero_training"


def generate_launch_description():
    return launch_description(SCENARIO)
