"""Instruments that measure the softmax bottleneck: rank, spectra, divergences."""
