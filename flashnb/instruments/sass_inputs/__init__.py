"""The SASS time model's inputs per kernel family: configurations, per-thread shapes, launch orders."""
