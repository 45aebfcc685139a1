"""Measurement and judgment: ``bcg bench`` (latency, build, memory per backend) and ``bcg analyze`` (p, launch
gap, coverage, graph memory and a verdict). Modules import torch lazily where they can so ``bcg --help`` is quick.
"""
