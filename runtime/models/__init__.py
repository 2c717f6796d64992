"""Model definitions (architecture only) and loaders that build them for the DLO engine."""
