"""ros2 launch kaitian_ros robot_edge.launch.py [strategy:=stripes slowdowns:=[3.0,1.0]]

The robot's own processor (compute_0, EMULATED slowdown 4.0) and an edge device (compute_1)
run one CNN together; the coordinator's planner picks how. The node graph and every parameter
come from config/robot_edge.yaml, the same file `kaitian launch robot_edge` reads; launch
arguments left unset keep the file's values. Shared logic: kaitian_ros/ros_launch.py.
"""

from kaitian_ros.ros_launch import launch_description

SCENARIO = "robot_edge"


def generate_launch_description():
    return launch_description(SCENARIO)
