"""Bridges to the T5X world: gin-driven evaluation with T5X's flags and output layout, and T5X export."""
