"""Hot kernels: a plain-torch reference plus per-device fast paths behind one interface."""
