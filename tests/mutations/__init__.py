"""Mutation testing: realistic bugs planted one at a time in a scratch copy of the repository, each of which the
CPU suite must catch.

    python -m tests.mutations                 # every mutation; exit status 1 if any survives (or cannot apply)
    python -m tests.mutations --list          # the catalog: name, area, the tests that should catch it
    python -m tests.mutations --only 'sr_'    # the mutations whose name matches a regex

The catalog (tests/mutations/catalog.py) names each bug by the source text it replaces, found wherever it lives
in the package, so that moving code between modules does not silently empty a mutation: text that is gone, or not
unique, is reported as stale and fails the run. The working tree is never touched.
"""
