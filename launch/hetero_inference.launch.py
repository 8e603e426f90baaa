"""ros2 launch kaitian_ros hetero_inference.launch.py [compute_nodes:=3 slowdowns:=[1.0,3.0,1.0]]

The node graph and every parameter come from config/hetero_inference.yaml, the same file
`kaitian launch hetero_inference` reads; launch arguments left unset keep the file's values.
Shared logic: kaitian_ros/ros_launch.py.
"""

from kaitian_ros.ros_launch import launch_description

SCENARIO = "hetero_inference"


def generate_launch_description():
    return launch_description(SCENARIO)
