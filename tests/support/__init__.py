"""Helpers that only the tests use: reference implementations and in-process stand-ins."""
