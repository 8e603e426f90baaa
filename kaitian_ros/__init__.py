"""kaitian_ros: heterogeneous collaborative inference and training as a ROS 2 package.

Layers point down only: launchers -> nodes -> runtime | training -> core
(runtime and training side by side; training uses core.models).
"""

__version__ = "0.1.0"
