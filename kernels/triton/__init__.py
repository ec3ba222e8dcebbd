"""Triton grouped expert MLP kernels (fused dequantize-in-the-loop). Imported only when triton is used."""
