"""Turnstile's engine: trajectories, encoding, backends, environments and the turn loop."""
