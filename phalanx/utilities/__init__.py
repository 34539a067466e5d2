"""Small helpers shared across phalanx."""
