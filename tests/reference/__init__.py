"""Test-only oracle: the NumPy float64 reference model and the llama.cpp comparison helpers."""
