"""Every on-disk checkpoint layout phalanx reads and writes, one module each."""
