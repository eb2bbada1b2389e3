"""The spectral core: Marchenko–Pastur, the delta spectrum and its cut, shrinkers (pure float64 math)."""
