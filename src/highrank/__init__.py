"""highrank: output layers that break the softmax bottleneck, and instruments that measure it."""

__version__ = "0.1.0"
