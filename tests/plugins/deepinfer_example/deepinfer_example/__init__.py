"""Test-only deepinfer backends, installed through their own entry points exactly as an outside vendor's would be.

- ``example_cpu`` (``correct.py``): a small correct backend, the worked example of writing a plugin.
- ``example_buggy`` (``buggy.py``): planted bugs that the conformance suite must report case by case.
"""
