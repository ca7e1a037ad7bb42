"""PLACEHOLDER for chapter 02: Format, DelayedScaling."""
Format = DelayedScaling = None
