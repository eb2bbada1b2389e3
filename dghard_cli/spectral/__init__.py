"""The spectral core: Marchenko–Pastur, the delta spectrum and its cut, shrinkers, LoRA spectra (pure float64 math)."""
