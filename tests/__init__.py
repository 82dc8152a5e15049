"""The CPU test suite (CI). A package, so that its helpers import as tests.helpers from any test file, from the
GPU suite (tests_multigpu) and from `python -m tests.mutations`."""
