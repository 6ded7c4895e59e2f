"""The harness around the library: a reference model and engine, traces, replay, stress, checks.

Nothing in the library imports from here.
"""
