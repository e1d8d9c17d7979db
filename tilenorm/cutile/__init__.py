"""cuTile kernels: one module per op, plus the shared fixed-order reduction."""
