"""The physical model resolved from a configuration: detector geometry, crystal orientation, beam sources,
spectra, structure factors, anomalous channels and background curves (layer 4, below the kernel)."""
