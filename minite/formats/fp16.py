"""PLACEHOLDER for chapter 01: DynamicLossScaler."""
DynamicLossScaler = None
