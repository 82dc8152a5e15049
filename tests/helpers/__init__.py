"""Helpers shared by the CPU and GPU test suites: the independent numerics oracle, the layer emulation, gloo
process groups for multi-rank tests, and a small GPT for convergence checks."""
