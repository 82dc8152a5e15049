"""The GPU test suite, its test matrix and run scripts. A package: run its scripts as modules from the repository
root (`python -m tests_multigpu.matrix ...`), so that they import tests.helpers."""
