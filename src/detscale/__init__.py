"""detscale: what does multi-GPU training buy a YOLO detector, and does it cost accuracy?"""

__version__ = "0.1.0"
