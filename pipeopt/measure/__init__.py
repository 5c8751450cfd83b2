"""Measuring a live run: per-step timing, windows, and the resources around them. No Lightning imports here."""
