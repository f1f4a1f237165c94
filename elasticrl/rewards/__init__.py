"""Rewards: Python functions named by import path, a remote HTTP endpoint, reward models,
combined by a declared weighted sum."""
