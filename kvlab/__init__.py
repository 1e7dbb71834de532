"""kvlab: measure what KV-cache compression does to memory, time, energy and quality."""

__version__ = "0.1.0"
