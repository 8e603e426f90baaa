"""ros2 launch kaitian_ros digits_demo.launch.py weights:=/path/digits_cnn.pt

A digits_cnn trained by `kaitian train --camera-inputs --save-weights PATH` classifies the
trainer's held-out digits, streamed as camera frames labelled in header.frame_id, on two
compute nodes (compute_1 EMULATED 3x slower). The node graph and every parameter come from
config/digits_demo.yaml, the same file `kaitian launch digits_demo` reads; launch arguments
left unset keep the file's values. Shared logic: kaitian_ros/ros_launch.py.
"""

from kaitian_ros.ros_launch import launch_description

SCENARIO = "digits_demo"


def generate_launch_description():
    return launch_description(SCENARIO)
