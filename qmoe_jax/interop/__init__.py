"""Interoperation with other projects: gin-driven evaluation with T5X's flags and output layout,
the export to stock T5X, and the QMoE authors' published compressed models."""
