"""The model parameters that the coordinator and the compute nodes share (which model, its
input, its weights, its class names). Apart from the nodes: `kaitian launch` checks a scenario's parameter names
against them before any node starts, without importing torch."""

from __future__ import annotations

from kaitian_ros.runtime.api import ParameterDescriptor as P
from kaitian_ros.runtime.api import ParameterType as T

MODEL_PARAMETERS = (
    P("model", T.STRING, "resnet18", "reference CNN name or 'package.module:callable'", read_only=True),
    P("input_height", T.INTEGER, 224, "model input height (rows)", 8, 4096, read_only=True),
    P("input_width", T.INTEGER, 224, "model input width", 8, 4096, read_only=True),
    P("input_channels", T.INTEGER, 3, "model input channels", 1, 4, read_only=True),
    P("num_classes", T.INTEGER, 1000, "classifier outputs", 1, 100000, read_only=True),
    P("seed", T.INTEGER, 0, "seed of the random weights (when no weights file)", 0, 2**31 - 1, read_only=True),
    P("weights", T.STRING, "", "state_dict file to load ('' = random weights from seed)", read_only=True),
    P("slab_rows", T.INTEGER, 8,
      "image rows per streamed input slab (the coordinator's planner may send a plan's input whole instead)",
      1, 4096),
    P("normalise", T.BOOL, True, "ImageNet mean/std normalisation of the input (on the compute nodes)",
      read_only=True),
    # the compute nodes need them too: on the direct path a node publishes FusedOutput itself
    P("labels", T.STRING_ARRAY, [], "class names by class index, num_classes of them (FusedOutput.top_label)",
      read_only=True),
    P("labels_file", T.STRING, "", "a UTF-8 file with one class name per line, instead of labels", read_only=True),
)
