"""Interoperation with other projects' files: the QMoE authors' published compressed models."""
