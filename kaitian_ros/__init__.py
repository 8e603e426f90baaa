"""kaitian_ros: heterogeneous collaborative inference and training as a ROS 2 package.

Layers point down only: launchers -> nodes -> runtime -> core/comm.
"""

__version__ = "0.1.0"
