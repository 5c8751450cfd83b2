"""Applying: the pieces that change a running fit (named so; measuring and deciding never mutate training)."""
