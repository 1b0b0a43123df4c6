"""The SASS time model's inputs per kernel family (configs, shapes, launch orders, edge tiles)."""
