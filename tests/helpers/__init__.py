"""Helpers shared by several test modules: plain functions and constants, never tests. Test
modules import from here, not from each other (tests/unit/test_test_layout.py checks it)."""
