"""Deciding: which configuration to try next and which one wins, from measured windows. No Lightning here."""
