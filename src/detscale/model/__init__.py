"""The YOLOv9 / GELAN detectors, their inference form, and post-processing.

``build_model(name, nc)`` gives the training form; ``fuse_for_inference(model)`` a fused copy
without the auxiliary branch; ``postprocess`` turns eval-mode outputs into detections and
``scale_boxes`` maps them back to the original image.
"""

from detscale.model.postprocess import postprocess, scale_boxes
from detscale.model.yolo import MODEL_NAMES, Detector, ModelError, build_model, fuse_for_inference

__all__ = [
    "MODEL_NAMES",
    "Detector",
    "ModelError",
    "build_model",
    "fuse_for_inference",
    "postprocess",
    "scale_boxes",
]
