"""Env modules the tests load by file path and by module path."""
